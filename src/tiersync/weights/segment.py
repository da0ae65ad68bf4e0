"""The shared-memory version segment: a trainer shard writes each version once, samplers
on the same host read their slices out of it (one write, many readers).

File layout: a 4096-byte header, then the shard's tensors, each at a 4096-aligned offset
(the offsets travel in the version's manifest). Header (little endian)::

    0   magic          8s  b"TSWSEG01"
    8   version        q   version being written or complete (-1: none yet)
    16  state          Q   0 empty, 1 writing, 2 complete
    24  payload_bytes  Q   bytes after the header (checked against the manifest on attach)

The writer sets ``version``/``state=writing`` before touching any tensor byte of a new
version, so a reader that copied version v and still sees ``version == v`` afterwards read
no byte of a later version (:meth:`SegmentReader.still_version`).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import stat
import struct
import weakref

import numpy as np
import numpy.typing as npt

from tiersync.errors import ClosedError, IntegrityError, UsageError
from tiersync.tiers.shm import pid_alive
from tiersync.tiers.shm_format import NO_ROOM, os_failure

__all__ = [
    "HEADER_BYTES",
    "SegmentPool",
    "SegmentReader",
    "SegmentWriter",
    "reclaim_stale",
    "tensor_offsets",
]

log = logging.getLogger(__name__)

MAGIC = b"TSWSEG01"
HEADER_BYTES = 4096
ALIGN = 4096
_HEAD = struct.Struct("<8sqQQ")
EMPTY, WRITING, COMPLETE = 0, 1, 2


def tensor_offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Payload offsets (4096-aligned, after the header) of tensors of ``sizes`` bytes, and the
    total payload size."""
    offsets, pos = [], 0
    for n in sizes:
        offsets.append(HEADER_BYTES + pos)
        pos += -(-n // ALIGN) * ALIGN
    return offsets, pos


SEGMENT_PREFIX = "tiersync-weights-"
"""Weights segments are named ``tiersync-weights-<publisher pid>-<rank>-<random>-<n>``."""


def segment_owner(path: str) -> int | None:
    """The pid of the publisher that created the weights segment ``path`` (its name says), or
    None when ``path`` is not named like one (``tiersync shm list`` tells live from stale)."""
    name = os.path.basename(path)
    if not name.startswith(SEGMENT_PREFIX):
        return None
    pid = name[len(SEGMENT_PREFIX) :].split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


def reclaim_stale(directory: str) -> list[str]:
    """Unlink the weights segments in ``directory`` whose publisher is gone: its pid does not
    run and no process holds the segment's lock (a writer holds it while the segment lives, so
    a publisher in another pid namespace keeps its segments). A publisher killed before it could
    unlink its segments (SIGKILL, SIGTERM without a handler) leaves them; the next one on the
    host removes them. Returns the paths unlinked."""
    try:
        names = [n for n in os.listdir(directory) if n.startswith(SEGMENT_PREFIX)]
    except OSError:
        return []
    gone = []
    for name in names:
        path = os.path.join(directory, name)
        pid = segment_owner(path)
        if pid is None or pid_alive(pid):
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by a live writer: BlockingIOError
            os.unlink(path)
            gone.append(path)
        except OSError:
            pass
        finally:
            os.close(fd)
    return gone


def _reserve(fd: int, path: str, size: int) -> None:
    """Reserve a segment's pages: a file system without room fails here (CapacityError), not
    with SIGBUS when the trainer first writes a page (a /dev/shm smaller than the shard, or
    filled by the versions zero-copy samplers still hold)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in NO_ROOM:
            raise os_failure(exc, path, "size", requested=size) from exc
        # a file system without fallocate: its pages come on first touch, as before


class SegmentWriter:
    """Creates and owns ``path`` (``payload_bytes`` after the header); unlinks it on close."""

    def __init__(self, path: str, payload_bytes: int) -> None:
        if payload_bytes < 0:
            raise UsageError("must be >= 0", argument="payload_bytes", value=payload_bytes)
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held while the segment lives: reclaim_stale leaves it
            os.ftruncate(fd, HEADER_BYTES + payload_bytes)
            self._map: mmap.mmap | None = mmap.mmap(fd, HEADER_BYTES + payload_bytes)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        # a publisher the program never closed still removes its name when the interpreter exits
        self._unlink_at_exit = weakref.finalize(self, _unlink_and_close, path, fd)
        self.payload_bytes, self._fd, self._reserved = payload_bytes, fd, False
        self._array: npt.NDArray[np.uint8] | None = np.frombuffer(self._map, dtype=np.uint8)
        self._write_head(-1, EMPTY)

    def _write_head(self, version: int, state: int) -> None:
        if self._map is None:
            raise _closed(self.path)
        self._map[: _HEAD.size] = _HEAD.pack(MAGIC, version, state, self.payload_bytes)

    def reserve(self) -> None:
        """Reserve every page before the first version is written (once; the caller does it
        outside its locks: zeroing gigabytes takes seconds). CapacityError when the file system
        has no room: before, the sparse file's first write past the room was a SIGBUS."""
        if self._map is None:
            raise _closed(self.path)
        if not self._reserved:
            _reserve(self._fd, self.path, HEADER_BYTES + self.payload_bytes)
            self._reserved = True

    def begin(self, version: int) -> None:
        """Mark ``version`` as being written (before any of its bytes land)."""
        self._write_head(version, WRITING)

    def complete(self, version: int) -> None:
        """Mark ``version`` complete."""
        self._write_head(version, COMPLETE)

    def region(self, offset: int, nbytes: int) -> np.ndarray:
        """A writable uint8 view of ``nbytes`` at file offset ``offset``."""
        array = self._array
        if array is None:
            raise _closed(self.path)
        if offset < HEADER_BYTES or offset + nbytes > len(array):
            raise UsageError("region outside the payload", argument="offset", offset=offset, nbytes=nbytes)
        return array[offset : offset + nbytes]

    def close(self) -> None:
        """Unmap and unlink; idempotent."""
        if self._map is None:
            return
        self._array = None
        try:
            self._map.close()
        except BufferError:  # a view is still alive (maybe in a reference cycle): collect, retry
            import gc

            gc.collect()
            try:
                self._map.close()
            except BufferError:
                pass  # the last view frees the mapping
        self._map = None
        self._unlink_at_exit()


def _closed(path: str) -> ClosedError:
    return ClosedError("the weights segment is closed", argument="segment", path=path)


def _unlink_and_close(path: str, fd: int) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    os.close(fd)  # drops the lock


class SegmentReader:
    """A read-only mapping of a writer's segment.

    Raises :class:`IntegrityError` when the file is missing, not a regular file (the path comes
    from the trainer's manifest: a FIFO or a device is refused without blocking, a symbolic
    link is not followed), has the wrong magic, or its size or header payload size differ from
    ``payload_bytes`` (what the manifest says).
    """

    def __init__(self, path: str, payload_bytes: int) -> None:
        self.path = path
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise IntegrityError("cannot open the weights segment", path=path, error=str(exc)) from exc
        try:
            st = os.fstat(fd)
            size = st.st_size
            if not stat.S_ISREG(st.st_mode):
                raise IntegrityError("the weights segment is not a regular file", path=path)
            if size != HEADER_BYTES + payload_bytes:
                raise IntegrityError(
                    "segment size differs from the manifest",
                    path=path,
                    size=size,
                    expected=HEADER_BYTES + payload_bytes,
                )
            mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        magic, _, _, payload = _HEAD.unpack(mapped[: _HEAD.size])
        if magic != MAGIC or payload != payload_bytes:
            mapped.close()
            raise IntegrityError("not a weights segment of this manifest", path=path, payload=payload)
        self._map: mmap.mmap | None = mapped
        self._array: npt.NDArray[np.uint8] | None = np.frombuffer(mapped, dtype=np.uint8)

    def header(self) -> tuple[int, int]:
        """``(version, state)`` as the writer left them."""
        if self._map is None:
            raise _closed(self.path)
        _, version, state, _ = _HEAD.unpack(self._map[: _HEAD.size])
        return version, state

    def still_version(self, version: int) -> bool:
        """True while the writer has not begun a version other than ``version``."""
        return self.header()[0] == version

    def region(self, offset: int, nbytes: int) -> np.ndarray:
        """A read-only uint8 view of ``nbytes`` at file offset ``offset``."""
        array = self._array
        if array is None:
            raise _closed(self.path)
        if offset < HEADER_BYTES or offset + nbytes > len(array):
            raise IntegrityError("region outside the segment", path=self.path, offset=offset, nbytes=nbytes)
        return array[offset : offset + nbytes]

    def close(self) -> None:
        if self._map is None:
            return
        self._array = None
        try:
            self._map.close()
        except BufferError:
            pass
        self._map = None


class SegmentPool:
    """A trainer shard's version segments under ``prefix`` (each ``payload_bytes``).

    Samplers that serve straight out of a segment (zero-copy) *hold* the version in it until
    they say they released it: :meth:`take` never hands out a held segment (nor the one
    just published), it makes a new one instead. A holder that goes away without releasing
    (:meth:`orphan`) retires its segments: they are unlinked and never written again (its
    mappings keep the pages alive); the one being published stays on disk until the next
    :meth:`take`, as other samplers still open it. Not thread-safe: the publisher calls it under its lock.
    """

    def __init__(self, prefix: str, payload_bytes: int) -> None:
        for path in reclaim_stale(os.path.dirname(prefix) or "."):
            log.info("removed %s: its publisher is gone", path)
        self.prefix, self.payload_bytes = prefix, payload_bytes
        self._segments: list[SegmentWriter] = []
        self._holders: dict[int, set[object]] = {}  # id(segment) -> holder keys
        self._version: dict[int, int] = {}  # id(segment) -> version written into it
        self.current: SegmentWriter | None = None
        self._made = 0

    def take(self, version: int, holders: set[object]) -> SegmentWriter:
        """The segment to write ``version`` into, now held by ``holders`` (zero-copy samplers)."""
        seg = next((s for s in self._segments if s is not self.current and not self._holders[id(s)]), None)
        if self.current is not None and not self._holders[id(self.current)]:
            seg = self.current  # nobody serves from it: rewrite in place (one segment, as before)
        if self.current is not None and self.current not in self._segments:
            self._forget(self.current)  # retired while current: its last writer mapping goes now
        if seg is None:
            seg = SegmentWriter(f"{self.prefix}-{self._made}", self.payload_bytes)
            self._made += 1
            self._segments.append(seg)
        self._holders[id(seg)] = set(holders)
        self._version[id(seg)] = version
        self.current = seg
        return seg

    def release(self, holder: object, version: int) -> None:
        """``holder`` no longer reads ``version``."""
        for s in self._segments:
            if self._version.get(id(s)) == version:
                self._holders[id(s)].discard(holder)

    def orphan(self, holder: object) -> None:
        """``holder`` went away: retire every segment it still held."""
        for s in [s for s in self._segments if holder in self._holders[id(s)]]:
            self._segments.remove(s)
            self._holders[id(s)] = {("retired", holder)}
            if s is not self.current:  # the current one is still written and announced: the next
                self._forget(s)  # take() or close() unmaps and unlinks it

    def _forget(self, s: SegmentWriter) -> None:
        """Unmap and unlink retired segment ``s`` and drop what was kept about it."""
        s.close()
        self._holders.pop(id(s), None)
        self._version.pop(id(s), None)

    def held(self) -> int:
        """Segments some holder still reads (for tests and stats)."""
        return sum(bool(self._holders[id(s)]) for s in self._segments)

    def close(self) -> None:
        """Unmap and unlink every segment."""
        if self.current is not None and self.current not in self._segments:
            self.current.close()
        for s in self._segments:
            s.close()
        self._segments, self.current = [], None
