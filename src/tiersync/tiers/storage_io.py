"""Low-level file I/O for the storage tier: O_DIRECT with a clean buffered fallback.

Measured on the virtio disk of the dev VM (cold reads of 64 MiB): O_DIRECT into
transparent-huge-page memory (what the host tier allocates) was ~1.2-1.6x a buffered
sequential read and wants requests in flight (one 8 MiB request at a time: ~1.05x; 8 of
4 MiB, the disk's largest request, did best); into 4 KiB pages it was slower than
buffered (the disk takes at most 254 segments per request, i.e. ~1 MiB of small pages);
buffered reads were best single-threaded with the kernel's own readahead (SEQUENTIAL or
WILLNEED over the file being read made them slower; WILLNEED of the *next* file helped).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from typing import TYPE_CHECKING

import numpy as np

from tiersync.iov import consume

if TYPE_CHECKING:
    from typing_extensions import Buffer

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_IOV_MAX = 512
ALIGN = 4096
_SCRATCH = memoryview(bytearray(ALIGN))  # padding between records lands here (never read back)
_ZEROS = memoryview(bytes(ALIGN))  # padding written after a record


class DirectIO:
    """Whether a tier still tries O_DIRECT: on when configured, off for good once the file system
    refuses it (one object shared by the tier's writer and its read passes)."""

    __slots__ = ("on",)

    def __init__(self, wanted: bool) -> None:
        self.on = wanted

    def refused(self) -> None:
        """The file system refused O_DIRECT: buffered I/O from now on."""
        self.on = False


def open_for_write(path: str, direct: bool) -> tuple[int, bool]:
    """Create ``path`` exclusively; try O_DIRECT first when ``direct``. Returns (fd, direct)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    if direct and _O_DIRECT:
        try:
            return os.open(path, flags | _O_DIRECT, 0o644), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            try:
                os.unlink(path)
            except OSError:
                pass
    return os.open(path, flags, 0o644), False


def open_for_read(path: str, direct: bool) -> tuple[int, bool]:
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
    if direct and _O_DIRECT:
        try:
            return os.open(path, flags | _O_DIRECT), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags), False


def pwritev_all(fd: int, bufs: Sequence[Buffer], offset: int) -> int:
    """Write every buffer at ``offset`` onward, resuming after short writes. Returns bytes written."""
    views = [memoryview(b).cast("B") for b in bufs]
    views = [v for v in views if len(v)]
    start = offset
    while views:
        n = os.pwritev(fd, views[:_IOV_MAX], offset)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += n
        consume(views, n)
    return offset - start


WRITE_CHUNK_NBYTES = 4 << 20


def write_file(
    path: str,
    header_nbytes: int,
    make_header: Callable[[list[int]], bytes],
    views: list[memoryview],
    checksum: Callable[[memoryview], int],
    *,
    direct: bool,
    fsync: bool,
    pool: Executor | None = None,
) -> tuple[bool, list[int]]:
    """Create ``path``: ``header_nbytes`` of header, then each view padded to ALIGN; fsync when asked.

    The payloads go first, in chunks of about WRITE_CHUNK_NBYTES: ``checksum`` of each
    view of a chunk is taken while the previous chunk is written on ``pool`` (``pwritev``
    releases the GIL), then ``make_header(checksums)`` is written at offset 0. With
    ``direct`` every view must be ALIGN-aligned in address and length. Returns (whether
    O_DIRECT was actually used — a file system that refuses it gets buffered I/O, the
    checksums). Raises OSError; the caller removes the file.
    """
    fd, direct = open_for_write(path, direct)
    pending: list[Future[int]] = []
    try:
        sums: list[int] = []
        off, chunk, size = header_nbytes, [], 0
        for n, v in enumerate(views):
            sums.append(checksum(v))
            chunk.append(v)
            size += len(v)
            if size >= WRITE_CHUNK_NBYTES or n == len(views) - 1:
                bufs = _padded(chunk, direct)
                pending.append(pool.submit(pwritev_all, fd, bufs, off) if pool else _done(pwritev_all(fd, bufs, off)))
                off += sum(len(b) for b in bufs)
                chunk, size = [], 0
        for f in pending:
            f.result()
        header = make_header(sums)
        head: bytes | mmap.mmap = header
        if direct:
            head = mmap.mmap(-1, len(header))
            head[:] = header
        pwritev_all(fd, [head], 0)
        if fsync:
            os.fsync(fd)
        return direct, sums
    except OSError as exc:
        if not direct or exc.errno != errno.EINVAL:
            raise
    finally:
        for f in pending:  # never close the fd under a write still in flight
            f.exception()
        os.close(fd)
    os.unlink(path)
    return False, write_file(path, header_nbytes, make_header, views, checksum, direct=False, fsync=fsync, pool=pool)[1]


def _padded(views: list[memoryview], direct: bool) -> list[memoryview]:
    if direct:
        return list(views)
    bufs: list[memoryview] = []
    for v in views:
        bufs.append(v)
        if len(v) % ALIGN:
            bufs.append(_ZEROS[: -len(v) % ALIGN])
    return bufs


def _done(value: int) -> Future[int]:
    f: Future[int] = Future()
    f.set_result(value)
    return f


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def preadv_all(fd: int, views: list[memoryview], offset: int) -> int:
    """Fill ``views`` back to back from ``offset``; returns bytes read (less at end of file)."""
    views = [v for v in views if len(v)]
    start = offset
    while views:
        n = os.preadv(fd, views[:_IOV_MAX], offset)
        if n == 0:
            break
        offset += n
        consume(views, n)
    return offset - start


def advise(fd: int, offset: int, length: int) -> None:
    """Best-effort ``posix_fadvise(WILLNEED)`` over a range (0 = to the end)."""
    fadvise = getattr(os, "posix_fadvise", None)
    if fadvise is None:
        return
    try:
        fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass


def prefetch_file(path: str, offset: int = 0, length: int = 0) -> None:
    """Start reading a range of ``path`` (0 = to the end) into the page cache; errors are ignored."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return
    try:
        advise(fd, offset, length)
    finally:
        os.close(fd)


def runs(extents: list[tuple[int, memoryview]], *, gaps: bool, max_nbytes: int) -> list[list[int]]:
    """Extent indices by offset, grouped into runs that one ``preadv`` can fill: contiguous
    (``gaps``: a gap under ALIGN, the record padding, is read into scratch), at most
    ``max_nbytes`` and _IOV_MAX iovecs."""
    order = sorted(range(len(extents)), key=lambda j: extents[j][0])
    out: list[list[int]] = []
    end, start, iovs = -1, 0, 0
    for j in order:
        off, v = extents[j]
        gap = off - end
        more = 1 + (gap > 0)
        if (
            out
            and (gap == 0 or (gaps and 0 < gap < ALIGN))
            and off + len(v) - start <= max_nbytes
            and iovs + more <= _IOV_MAX
        ):
            out[-1].append(j)
            iovs += more
        else:
            out.append([j])
            start, iovs = off, 1
        end = off + len(v)
    return out


def read_run(fd: int, extents: list[tuple[int, memoryview]], run: list[int]) -> list[int]:
    """Fill the extents of ``run`` (see :func:`runs`) with one ``preadv`` straight into their
    views (resumed after a short read); returns the bytes each got (less at end of file)."""
    iovs, pos = [], extents[run[0]][0]
    for j in run:
        off, v = extents[j]
        if off > pos:
            iovs.append(_SCRATCH[: off - pos])
        iovs.append(v)
        pos = off + len(v)
    start = extents[run[0]][0]
    total = preadv_all(fd, iovs, start)
    return [max(min(total - (extents[j][0] - start), len(extents[j][1])), 0) for j in run]


def append_file(path: str, data: bytes, *, fsync: bool) -> None:
    """Append ``data`` to ``path`` (created if absent) with one O_APPEND write."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def aligned(v: memoryview) -> bool:
    """Whether ``v`` may be an O_DIRECT buffer (address and length multiples of ALIGN)."""
    if not len(v) or len(v) % ALIGN:
        return False
    try:
        addr = ctypes.addressof(ctypes.c_char.from_buffer(v))  # ~0.3 us; numpy's address is ~7 us
    except TypeError:  # a read-only buffer
        addr = np.frombuffer(v, dtype=np.uint8).ctypes.data
    return addr % ALIGN == 0
