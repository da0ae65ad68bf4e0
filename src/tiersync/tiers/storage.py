"""The storage tier: KV blocks in a directory on a local SSD or a shared file system.

Format and why (details in :mod:`tiersync.tiers.storage_format`): a write batch becomes
an immutable *segment* file — a header area with a per-record descriptor (magic,
version, cache-identity digest, key, offset, length, xxh3_64 of the payload, self
checksum) followed by 4 KiB-aligned payloads. It is written under a temporary name
with one ``pwritev``, fsynced, atomically renamed and the directory fsynced
(:mod:`tiersync.tiers.storage_write`); the write's future completes only after that,
so an acknowledged block survives a SIGKILL or power loss and a reader (this or
another process or machine) never sees a half-written segment. Write batches queued together (while
the workers are busy) are packed into one segment of up to ``segment_bytes`` — one file and one
fsync for the burst, long files for sequential reads.

Reads queued together are served by one pass (:mod:`tiersync.tiers.storage_read`):
per segment, sorted, contiguous records merged into long ``preadv`` calls straight
into the destination views — O_DIRECT with several in flight when the views are
aligned, else buffered in order with a WILLNEED of the next segment — each block
verified as soon as it is in.

Index: on open, and on :meth:`refresh` (the store calls it on a lookup miss), the
directory is scanned (outside the index lock; one scan at a time); segments of another
cache identity are ignored (``foreign``), bad descriptors and records past the end of
the file are skipped and counted (``corrupt``, ``truncated``), records named by the
segment's tombstone sidecar (deleted, by any process) are skipped — deletion is
durable, a restart never brings back what was dropped (:mod:`tiersync.tiers.storage_index`).
Every read verifies the payload checksum; a failing block is reported ``CORRUPT``,
deleted and never served.

Errors: a full disk (ENOSPC/EDQUOT) raises :class:`CapacityError`; a directory that
cannot be written (EACCES/EPERM/EROFS) raises :class:`UsageError` naming
``StorageConfig.directory``. Either way the temporary file is removed and the index
is unchanged. Reads of vanished or unreadable files are misses (``MISSING``,
``UNREADABLE``). Thread-safe; I/O runs on ``workers`` threads and returns futures.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import socket
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from tiersync.errors import ClosedError, UsageError, check_positive_int
from tiersync.tiers import storage_format as fmt
from tiersync.tiers import storage_io as sio
from tiersync.tiers.shm import pid_alive
from tiersync.tiers.storage_index import SegmentIndex, unlink_quiet
from tiersync.tiers.storage_queue import Combiner
from tiersync.tiers.storage_read import ReadPass, ReadStatus
from tiersync.tiers.storage_write import SegmentWriter, take_writes

__all__ = ["ReadStatus", "StorageConfig", "StorageStats", "StorageTier"]

log = logging.getLogger(__name__)
_THREAD_PREFIX = "tiersync-storage"
_READ_PASSES = 2  # a lone read is served at once; what queues meanwhile shares the second pass
_Request = tuple[list[bytes], list[memoryview]]  # (keys, views) of one write or read
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class StorageConfig:
    """``directory`` holding segments of the cache ``identity`` (16-byte digest).

    ``workers`` threads run segment writes in parallel (reads: at most two passes at a
    time, sharing ``read_depth`` O_DIRECT requests in flight). ``segment_bytes``: write batches
    queued together are packed into one segment of at most this many payload bytes (a
    single larger batch is one segment of its own). ``direct_io`` reads with O_DIRECT
    (skips the page cache and its copy: into huge-page host memory it was ~1.2-1.6x a
    buffered read on the virtio disk we measured) and ``direct_writes`` writes with it
    (from huge-page memory ~1.3x buffered writes + fsync there; from 4 KiB pages it was
    slower); either falls back to buffered I/O when the file system or the buffers'
    alignment refuse it. ``fsync`` makes writes durable before
    their future completes (turn off only for throwaway caches); ``capacity_blocks``
    bounds how many blocks the store keeps here (None = until the disk is full).
    """

    directory: str
    identity: bytes
    workers: int = 4
    direct_io: bool = True
    direct_writes: bool = True
    fsync: bool = True
    capacity_blocks: int | None = None
    segment_bytes: int = 16 << 20
    read_depth: int = 8

    def __post_init__(self) -> None:
        if not isinstance(self.directory, str) or not self.directory:
            raise UsageError("must be a non-empty str", argument="StorageConfig.directory")
        if not isinstance(self.identity, bytes) or len(self.identity) != 16:
            raise UsageError("must be a 16-byte digest", argument="StorageConfig.identity")
        check_positive_int(self.workers, "StorageConfig.workers")
        check_positive_int(self.capacity_blocks, "StorageConfig.capacity_blocks", allow_none=True)
        check_positive_int(self.segment_bytes, "StorageConfig.segment_bytes")
        check_positive_int(self.read_depth, "StorageConfig.read_depth")


@dataclass(frozen=True, slots=True)
class StorageStats:
    blocks: int
    segments: int
    corrupt: int
    truncated: int
    foreign_segments: int
    unreadable_segments: int
    read_corrupt: int
    bytes_written: int
    bytes_read: int
    direct_io: bool
    deleted: int = 0  # records skipped at scan because a tombstone names them


class StorageTier:
    """Blocks of one cache identity in one directory (see module docstring)."""

    def __init__(self, config: StorageConfig) -> None:
        if not isinstance(config, StorageConfig):
            raise UsageError("must be a StorageConfig", argument="config", got=type(config).__name__)
        self.config = config
        self.directory = os.path.abspath(config.directory)
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as exc:
            raise UsageError(
                "cannot create the storage directory",
                argument="StorageConfig.directory",
                path=self.directory,
                error=exc.strerror,
            ) from exc
        self._prefix = config.identity.hex() + "-"
        self._host = re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname())[:32] or "host"
        self._writer = f"{self._host}.{os.getpid()}.{os.urandom(3).hex()}"
        self.writable = self._probe_writable()
        """Whether this process can write here (probed at construction; reads work either way)."""
        self._index = SegmentIndex(self.directory, config.identity)
        self._lock = self._index.lock  # the index; never held during I/O
        self._locs = self._index.locs
        self._scan_lock = threading.Lock()  # one directory scan at a time
        self._direct = sio.DirectIO(config.direct_io)
        self._pool = ThreadPoolExecutor(config.workers, thread_name_prefix=_THREAD_PREFIX)
        self._writes = Combiner(
            self._pool,
            self._serve_writes,
            max_active=config.workers,
            take=functools.partial(take_writes, segment_bytes=config.segment_bytes),
        )
        self._io = ThreadPoolExecutor(config.read_depth, thread_name_prefix=_THREAD_PREFIX + "-read")
        self._segments = SegmentWriter(
            self.directory,
            config.identity,
            f"{self._prefix}{self._writer}-",
            self._index,
            self._direct,
            self._io,
            direct_writes=config.direct_writes,
            fsync=config.fsync,
        )
        self._reads: Combiner[_Request, list[ReadStatus]] = Combiner(
            self._pool,
            lambda reqs: ReadPass(self._index, self.directory, self._direct, reqs, self._io).run(),
            max_active=_READ_PASSES,
        )
        self._closed = False
        self._remove_orphans()
        self.refresh()

    def _probe_writable(self) -> bool:
        """Create and remove a probe file: a read-only or foreign directory is said at once
        (one WARNING), not found out by the first write."""
        probe = os.path.join(self.directory, f"{fmt.TMP_PREFIX}{self._prefix}{self._writer}.probe")
        try:
            os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            os.unlink(probe)
            return True
        except OSError as exc:
            log.warning(
                "storage directory %s is not writable (%s): it serves reads only, every write is refused",
                self.directory,
                exc.strerror,
            )
            return False

    def __repr__(self) -> str:
        return f"<StorageTier {self.directory} blocks={len(self._locs)} segments={len(self._index.live)}>"

    # -- index ---------------------------------------------------------------
    def refresh(self) -> list[bytes]:
        """Scan segments not seen yet (new ones from any process). Returns the keys added.

        The scan holds no lock that lookups or I/O need; concurrent calls wait for the
        one in progress (so a key written before either call is known when both return).
        """
        self._check_open()
        with self._scan_lock:
            try:
                names = sorted(n for n in os.listdir(self.directory) if n.endswith(fmt.SUFFIX))
            except OSError:
                return []
            added: list[bytes] = []
            for name in names:
                if not self._index.claim(name):
                    continue
                if not name.startswith(self._prefix):
                    self._index.bump("foreign")
                    continue
                added += self._index.scan(name)
            return added

    def in_io_thread(self) -> bool:
        """Whether the caller runs on one of this tier's threads (e.g. in a future's callback),
        where waiting for another of its I/O requests could deadlock."""
        return threading.current_thread().name.startswith(_THREAD_PREFIX)

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._locs

    def forget(self, keys: Sequence[bytes]) -> None:
        """Stop offering ``keys`` in this process (a block this reader can never use, such as one
        of another size); the files stay for other readers of the directory."""
        with self._lock:
            for k in keys:
                self._locs.pop(bytes(k), None)

    def stored_length(self, key: bytes) -> int | None:
        """Bytes of the stored block ``key`` (as its checksummed descriptor says), None when unknown."""
        with self._lock:
            loc = self._locs.get(key)
            return None if loc is None else loc.record.length

    def keys(self) -> list[bytes]:
        """Known keys, oldest segment first (a good initial LRU order)."""
        with self._lock:
            return [k for k, _ in sorted(self._locs.items(), key=lambda kv: (kv[1].seq, kv[1].segment))]

    @property
    def num_blocks(self) -> int:
        return len(self._locs)

    def stats(self) -> StorageStats:
        with self._lock:
            c = self._index.counts
            return StorageStats(
                len(self._locs),
                len(self._index.live),
                c["corrupt"],
                c["truncated"],
                c["foreign"],
                c["unreadable"],
                c["read_corrupt"],
                c["bytes_written"],
                c["bytes_read"],
                self._direct.on,
                c["deleted"],
            )

    def delete(self, keys: Sequence[bytes]) -> None:
        """Forget ``keys`` for good (this process and any later scan, e.g. after a restart).

        A segment none of whose blocks is live any more is unlinked; otherwise the
        deleted records are appended to its tombstone sidecar (one small write, no
        fsync here: it survives a SIGKILL at once and a power loss after the next
        segment write or :meth:`close`). Unknown keys are ignored.
        """
        with self._lock:
            dead = self._index.drop([(bytes(k), None) for k in keys])
        self._index.bury(dead)

    # -- writes --------------------------------------------------------------
    def write(self, keys: Sequence[bytes], views: Sequence[memoryview]) -> Future[None]:
        """Write blocks (packed with other queued writes into one segment). ``views`` must stay
        unchanged until the future is done.

        Result: None once durable and indexed. Errors: CapacityError (disk full),
        UsageError (directory not writable); the index is then unchanged.
        """
        self._check_open()
        keys = [bytes(k) for k in keys]
        if len(keys) != len(views) or not keys:
            raise UsageError(
                "needs one view per key and at least one key", argument="views", keys=len(keys), views=len(views)
            )
        for k in keys:
            if not 0 < len(k) <= fmt.MAX_KEY_NBYTES:
                raise UsageError(f"keys must be 1..{fmt.MAX_KEY_NBYTES} bytes", argument="keys", key=k)
        return self._submit(self._writes, (keys, [memoryview(v).cast("B") for v in views]))

    def _submit(self, combiner: Combiner[_Request, _T], request: _Request) -> Future[_T]:
        try:
            return combiner.submit(request)
        except RuntimeError as exc:  # the pool shut down between the check and the submit
            raise ClosedError("storage tier is closed") from exc

    def _serve_writes(self, reqs: list[_Request]) -> list[None]:
        batch: dict[bytes, memoryview] = {}  # key -> view; a key written twice in a burst keeps its last bytes
        for keys, views in reqs:
            batch.update(zip(keys, views))
        self._index.sync_tombstones()
        self._write_segment(list(batch), list(batch.values()))
        return [None] * len(reqs)

    def _write_segment(self, keys: list[bytes], views: list[memoryview]) -> None:
        self._segments.write(keys, views)

    # -- reads ---------------------------------------------------------------
    def read(self, keys: Sequence[bytes], views: Sequence[memoryview]) -> Future[list[ReadStatus]]:
        """Read blocks into ``views`` (each exactly the stored length). Result: one ReadStatus per key.

        A view whose status is not OK holds unspecified bytes and must not be used; an
        OK view passed its checksum.
        """
        self._check_open()
        if len(keys) != len(views):
            raise UsageError("needs one view per key", argument="views", keys=len(keys), views=len(views))
        keys, views = [bytes(k) for k in keys], [memoryview(v).cast("B") for v in views]
        with self._lock:  # a view of the wrong size is the caller's mistake: refused, nothing read or dropped
            for i, (k, v) in enumerate(zip(keys, views)):
                loc = self._locs.get(k)
                if v.readonly or (loc is not None and len(v) != loc.record.length):
                    raise UsageError(
                        "each view must be writable and exactly as long as its stored block",
                        argument="views",
                        index=i,
                        key=k.hex(),
                        nbytes=len(v),
                        stored=loc.record.length if loc else None,
                        readonly=v.readonly,
                    )
        return self._submit(self._reads, (keys, views))

    # -- helpers -------------------------------------------------------------
    def _remove_orphans(self) -> None:
        """Delete temporary files left by dead writers of this host (crashed mid-write) and
        tombstone sidecars whose segment is gone."""
        try:
            names = set(os.listdir(self.directory))
        except OSError:
            return
        pat = re.compile(re.escape(fmt.TMP_PREFIX + self._prefix + self._host) + r"\.(\d+)\.")
        for n in names:
            m = pat.match(n)
            dead_tmp = m is not None and not pid_alive(int(m.group(1)))
            stale_tomb = (
                n.startswith(self._prefix)
                and n.endswith(fmt.SUFFIX + fmt.TOMB_SUFFIX)
                and n[: -len(fmt.TOMB_SUFFIX)] not in names
            )
            if dead_tmp or stale_tomb:
                unlink_quiet(os.path.join(self.directory, n))

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("storage tier is closed")

    def close(self) -> None:
        """Finish queued I/O, make deletions durable and stop. Idempotent; the files stay."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        self._io.shutdown(wait=True)
        self._index.sync_tombstones()

    def __enter__(self) -> StorageTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
