"""Warm boot: host-arena payload in a POSIX shared-memory file that survives a restart.

A segment is the file ``{directory}/tiersync-{server_name}-{key}`` (``directory`` is
``/dev/shm`` by default). It holds a header (identity and geometry), a manifest of one
entry per host block and the page-aligned payload; see :mod:`tiersync.tiers.shm_format`.
:meth:`ShmSegment.open` attaches when the header matches the model id, the geometry and
the file size, and otherwise formats the file (a *cold start*, logged once with its
reason). :meth:`ShmSegment.recover` then returns every block whose save completed.

Save protocol (what makes recovery crash-safe): ``invalidate([b])`` before rewriting block
``b``; write the bytes into ``payload``; ``publish(b, key)``. ``publish`` checksums the
block, writes the entry and sets the valid word last (call it only once the bytes are fully
written, e.g. after the D2H copy's future is done), so a process killed at any moment
leaves each block either absent or byte-exact; a block rewritten without ``invalidate``
fails its checksum and is dropped (and counted in ``stats.torn``).

While attached the process holds ``flock(LOCK_EX)`` on the file: a second live process
is refused with a :class:`UsageError`; the lock dies with the process (SIGKILL included).

Listing and reclaiming segments (wrapped by the ``tiersync shm list|reclaim`` CLI)::

    from tiersync.tiers.shm import ShmSegment
    for info in ShmSegment.list_segments("/dev/shm"):
        print(info.path, info.server_name, info.key, info.model_id, info.size, info.valid_blocks,
              info.problem)           # problem: ColdStart if the header is unusable, else None
    ShmSegment.reclaim("/dev/shm/tiersync-default-mykey")   # unlink; refused while attached

Segments are never deleted automatically: ``close()`` keeps the file (that is the point),
so reclaim the ones of retired servers to give the memory back.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import operator
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tiersync.errors import ClosedError, UsageError, check_positive_int
from tiersync.tiers import shm_format as fmt
from tiersync.tiers.shm_format import ColdStart, SegmentInfo

__all__ = ["ColdStart", "Geometry", "RecoveredBlock", "SegmentInfo", "ShmConfig", "ShmSegment", "ShmStats", "pid_alive"]

log = logging.getLogger("tiersync.shm")


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (another user's process counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_PREFIX = fmt.PREFIX


def _check_name(value: object, argument: str) -> None:
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise UsageError("must match [A-Za-z0-9._-]{1,64}", argument=argument, value=value)


@dataclass(frozen=True, slots=True)
class ShmConfig:
    """Where a segment lives and whose it is. Validated on construction (UsageError)."""

    key: str
    model_id: str
    server_name: str = "default"
    directory: str = "/dev/shm"

    def __post_init__(self) -> None:
        _check_name(self.key, "key")
        _check_name(self.server_name, "server_name")
        if not isinstance(self.model_id, str) or not self.model_id:
            raise UsageError("must be a non-empty str", argument="model_id")
        if len(self.model_id.encode("utf-8")) > fmt.MAX_MODEL_ID_NBYTES:
            raise UsageError(f"longer than {fmt.MAX_MODEL_ID_NBYTES} UTF-8 bytes", argument="model_id")
        if not isinstance(self.directory, str) or not self.directory:
            raise UsageError("must be a non-empty str", argument="directory")

    @property
    def path(self) -> str:
        """The segment file: ``{directory}/tiersync-{server_name}-{key}``."""
        return os.path.join(self.directory, f"{_PREFIX}{self.server_name}-{self.key}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ShmConfig | None:
        """Config from TIERSYNC_SHM_KEY / _MODEL_ID / _SERVER_NAME / _SHM_DIR.

        None when TIERSYNC_SHM_KEY is unset or empty (shm backing off). With a key,
        TIERSYNC_MODEL_ID is required (UsageError otherwise).
        """
        env = os.environ if environ is None else environ
        key = env.get("TIERSYNC_SHM_KEY")
        if not key:
            return None
        model_id = env.get("TIERSYNC_MODEL_ID")
        if not model_id:
            raise UsageError("required when TIERSYNC_SHM_KEY is set", argument="TIERSYNC_MODEL_ID")
        return cls(
            key=key,
            model_id=model_id,
            server_name=env.get("TIERSYNC_SERVER_NAME") or "default",
            directory=env.get("TIERSYNC_SHM_DIR") or "/dev/shm",
        )


@dataclass(frozen=True, slots=True)
class Geometry:
    """Shape of the arena: ``num_blocks`` blocks of ``block_nbytes``; ``layout_digest`` (16 B)
    identifies pool specs, dtypes and tags (computed by the caller)."""

    num_blocks: int
    block_nbytes: int
    layout_digest: bytes

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_nbytes"):
            check_positive_int(getattr(self, name), name)
        if not isinstance(self.layout_digest, bytes) or len(self.layout_digest) != 16:
            raise UsageError("must be 16 bytes", argument="layout_digest")


@dataclass(frozen=True, slots=True)
class RecoveredBlock:
    """A block whose save completed: its first ``nbytes`` payload bytes are ``key``'s data."""

    block: int
    key: bytes
    seq: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class ShmStats:
    """Counters since open: entries recovered, dropped as torn (checksum) or malformed, and
    publish / invalidate calls."""

    recovered: int = 0
    torn: int = 0
    malformed: int = 0
    published: int = 0
    invalidated: int = 0


class ShmSegment:
    """An attached segment. Not thread-safe; one per process per path (flock enforced)."""

    __slots__ = (
        "_closed",
        "_counts",
        "_fd",
        "_header",
        "_mm",
        "_next_seq",
        "address",
        "cold_start",
        "config",
        "geometry",
        "payload",
    )

    def __init__(
        self, config: ShmConfig, geometry: Geometry, cold_start: ColdStart | None, fd: int, header: fmt.Header
    ) -> None:
        """Internal: use :meth:`open`. Maps ``fd``, which must be locked and fully formatted."""
        self.config, self.geometry, self.cold_start = config, geometry, cold_start
        self._fd, self._header, self._closed = fd, header, False
        try:
            self._mm = mmap.mmap(fd, header.file_nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            raise fmt.os_failure(exc, config.path, "map", requested=header.file_nbytes) from exc
        off, n = header.payload_offset, header.payload_nbytes
        #: Writable view of the whole payload; block b is payload[b*block_nbytes:(b+1)*block_nbytes].
        self.payload = memoryview(self._mm)[off : off + n]
        #: Virtual address of payload[0] in this process, for native copiers.
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._mm, off))
        self._counts = dict.fromkeys(ShmStats.__slots__, 0)
        seqs = [e.seq for e in self._entries() if e.valid == fmt.VALID_MAGIC]
        self._next_seq = max(seqs, default=0) + 1

    @classmethod
    def open(cls, config: ShmConfig, geometry: Geometry) -> ShmSegment:
        """Attach to ``config.path`` if it holds a valid segment of this model and geometry,
        else (re)format it; ``cold_start`` says which (None = warm attach).

        Raises UsageError if the file cannot be opened or created (naming the path) or
        another live process has it attached, CapacityError if the file system has no room
        for the segment (checked with posix_fallocate here, never a SIGBUS later).
        """
        if not isinstance(config, ShmConfig) or not isinstance(geometry, Geometry):
            raise UsageError("expected ShmConfig and Geometry", argument="config")
        path = config.path
        wanted = fmt.make_header(
            num_blocks=geometry.num_blocks,
            block_nbytes=geometry.block_nbytes,
            layout_digest=geometry.layout_digest,
            model_id=config.model_id,
            server_name=config.server_name,
            key=config.key,
        )
        fd = fmt.open_locked(path)
        try:
            problem = fmt.attach_problem(fd, wanted)
            if problem is not None:
                fmt.format_segment(fd, path, wanted)
            segment = cls(config, geometry, None if problem is None else problem[0], fd, wanted)
        except BaseException:
            os.close(fd)
            raise
        segment._log_open(problem)
        return segment

    def _log_open(self, problem: tuple[ColdStart, str] | None) -> None:
        if problem is None:
            log.info("shm warm attach %s (%d blocks)", self.config.path, self.geometry.num_blocks)
        elif problem[0] is ColdStart.NEW:
            log.info("shm cold start (new) %s: %s", self.config.path, problem[1])
        else:
            log.warning(
                "shm cold start (%s) %s: %s; segment reformatted, cache empty",
                problem[0].value,
                self.config.path,
                problem[1],
            )

    @property
    def stats(self) -> ShmStats:
        """Snapshot of the counters."""
        return ShmStats(**self._counts)

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("shm segment is closed", path=self.config.path)

    def _check_block(self, block: int) -> int:
        try:
            index = operator.index(block)
        except TypeError:
            index = -1
        if not 0 <= index < self.geometry.num_blocks:
            raise UsageError(f"must be an int in [0, {self.geometry.num_blocks})", argument="block", value=block)
        return index

    def _entry_at(self, block: int) -> int:
        return fmt.HEADER_NBYTES + block * fmt.ENTRY_NBYTES

    def _block_view(self, block: int, nbytes: int) -> memoryview:
        start = block * self.geometry.block_nbytes
        return self.payload[start : start + nbytes]

    def _entries(self) -> list[fmt.Entry]:
        """The manifest, decoded (index = block)."""
        start = fmt.HEADER_NBYTES
        return fmt.read_entries(self._mm[start : start + self.geometry.num_blocks * fmt.ENTRY_NBYTES])

    def recover(self) -> list[RecoveredBlock]:
        """Blocks flagged valid whose checksum verifies, oldest ``seq`` first.

        Entries flagged valid that fail the checksum (torn) or carry impossible fields
        (malformed) are invalidated and counted in :attr:`stats`; they are never returned,
        and later publishes number their seqs after the newest block returned.
        """
        self._check_open()
        found = []
        for block, e in enumerate(self._entries()):
            if e.valid == 0:
                continue
            status = self._verify(block, e)
            self._counts[status] += 1
            if status == "recovered":
                found.append(RecoveredBlock(block, e.key, e.seq, e.nbytes))
            else:
                fmt.set_valid(self._mm, self._entry_at(block), False)
        found.sort(key=lambda r: r.seq)
        # Continue after the newest *verified* entry: a damaged one (say, its seq rotted to
        # 2**64 - 1) counted at open and would push every later publish past a u64.
        self._next_seq = found[-1].seq + 1 if found else 1
        return found

    def _verify(self, block: int, e: fmt.Entry) -> str:
        """'recovered', 'torn' (checksum mismatch) or 'malformed' (impossible fields)."""
        if e.valid != fmt.VALID_MAGIC or e.key_len > fmt.MAX_KEY_NBYTES or e.nbytes > self.geometry.block_nbytes:
            return "malformed"
        actual = fmt.entry_checksum(e.seq, e.nbytes, e.key, self._block_view(block, e.nbytes))
        return "recovered" if actual == e.checksum else "torn"

    def invalidate(self, blocks: Sequence[int]) -> None:
        """Mark the entries of ``blocks`` not valid. Call BEFORE rewriting a block's bytes.

        All indices are checked first (UsageError); then every entry is cleared.
        """
        self._check_open()
        checked = [self._check_block(b) for b in blocks]
        for block in checked:
            fmt.set_valid(self._mm, self._entry_at(block), False)
        self._counts["invalidated"] += len(checked)

    def publish(self, block: int, key: bytes, nbytes: int | None = None) -> int:
        """Record that ``block``'s first ``nbytes`` (default: all) payload bytes are ``key``'s.

        Clears the valid word, checksums the bytes, writes seq / key / nbytes / checksum,
        then sets the valid word last. ``key`` is at most 32 bytes. Returns the new seq,
        which grows monotonically (continuing after the largest seq flagged valid at open,
        then after the largest one :meth:`recover` verified).
        """
        self._check_open()
        block = self._check_block(block)
        if not isinstance(key, (bytes, bytearray, memoryview)) or len(bytes(key)) > fmt.MAX_KEY_NBYTES:
            raise UsageError(f"must be bytes of length <= {fmt.MAX_KEY_NBYTES}", argument="key")
        key = bytes(key)
        nbytes = self.geometry.block_nbytes if nbytes is None else nbytes
        if not isinstance(nbytes, int) or not 0 <= nbytes <= self.geometry.block_nbytes:
            raise UsageError(f"must be in [0, {self.geometry.block_nbytes}]", argument="nbytes", value=nbytes)
        at = self._entry_at(block)
        fmt.set_valid(self._mm, at, False)
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        checksum = fmt.entry_checksum(seq, nbytes, key, self._block_view(block, nbytes))
        fmt.write_entry(self._mm, at, seq, nbytes, key, checksum)
        fmt.set_valid(self._mm, at, True)
        self._counts["published"] += 1
        return seq

    def close(self) -> None:
        """Unmap and unlock; the file stays for the next boot. Idempotent.

        Views derived from :attr:`payload` must be released first: if any remain, raises
        UsageError and stays attached (call again once they are gone).
        """
        if self._closed:
            return
        self.payload.release()
        try:
            self._mm.close()
        except BufferError:
            off, n = self._header.payload_offset, self._header.payload_nbytes
            self.payload = memoryview(self._mm)[off : off + n]
            raise UsageError(
                "views of payload are still alive; release them before close", argument="payload"
            ) from None
        os.close(self._fd)
        self._closed = True

    def __enter__(self) -> ShmSegment:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @staticmethod
    def list_segments(directory: str = "/dev/shm") -> list[SegmentInfo]:
        """Every ``tiersync-*`` file in ``directory``, sorted by path, with its parsed header.

        Read-only: takes no lock and never modifies a file. UsageError if ``directory``
        cannot be listed.
        """
        try:
            names = sorted(n for n in os.listdir(directory) if n.startswith(_PREFIX))
        except OSError as exc:
            raise UsageError(f"cannot list {directory}: {exc.strerror}", argument="directory") from exc
        infos = []
        for name in names:
            path = os.path.join(directory, name)
            if os.path.isfile(path):
                infos.append(fmt.inspect(path))
        return infos

    @staticmethod
    def reclaim(path: str) -> None:
        """Unlink the segment file ``path`` (a ``tiersync-*`` file), freeing its memory.

        UsageError if the name is not a segment's, the file is missing, or a live process
        has it attached.
        """
        if not os.path.basename(path).startswith(_PREFIX):
            raise UsageError(f"not a tiersync segment name: {path}", argument="path")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise UsageError(f"cannot reclaim {path}: {exc.strerror}", argument="path") from exc
        fmt.lock_or_refuse(fd, path)
        try:
            os.unlink(path)
        finally:
            os.close(fd)
