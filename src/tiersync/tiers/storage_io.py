"""Low-level file I/O for the storage tier: O_DIRECT with a clean buffered fallback."""
from __future__ import annotations

import errno
import mmap
import os

from tiersync.iov import consume

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_IOV_MAX = 512
ALIGN = 4096


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


def pwritev_all(fd: int, bufs: list, offset: int) -> int:
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


def write_file(path: str, header: bytes, views: list[memoryview], *, direct: bool, fsync: bool) -> bool:
    """Create ``path`` holding ``header`` then each view padded to ALIGN; fsync when asked.

    With ``direct`` every view must be ALIGN-aligned in address and length; returns
    whether O_DIRECT was actually used (a file system that refuses it gets buffered I/O).
    """
    fd, direct = open_for_write(path, direct)
    try:
        if direct:
            head = mmap.mmap(-1, len(header))
            head[:] = header
            bufs: list = [head, *views]
        else:
            bufs = [header]
            for v in views:
                bufs.append(v)
                pad = -len(v) % ALIGN
                if pad:
                    bufs.append(bytes(pad))
        try:
            pwritev_all(fd, bufs, 0)
        except OSError as exc:
            if not direct or exc.errno != errno.EINVAL:
                raise
            os.close(fd)
            fd = -1
            os.unlink(path)
            write_file(path, header, views, direct=False, fsync=fsync)
            return False
        if fsync:
            os.fsync(fd)
        return direct
    finally:
        if fd >= 0:
            os.close(fd)


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


def read_extents(path: str, extents: list[tuple[int, memoryview]], direct: bool) -> tuple[list[int], bool]:
    """Read ``(offset, view)`` extents of one file, merging adjacent ones into one preadv.

    Returns (bytes read per extent, whether O_DIRECT was used). Raises OSError from open;
    an EINVAL under O_DIRECT is retried buffered (the returned flag says so).
    """
    fd, direct = open_for_read(path, direct)
    try:
        return _read_runs(fd, extents), direct
    except OSError as exc:
        if not direct or exc.errno != errno.EINVAL:
            raise
    finally:
        os.close(fd)
    return read_extents(path, extents, False)[0], False


def _read_runs(fd: int, extents: list[tuple[int, memoryview]]) -> list[int]:
    order = sorted(range(len(extents)), key=lambda j: extents[j][0])
    got = [0] * len(extents)
    run: list[int] = []
    for j in order + [-1]:
        if run and (j < 0 or extents[j][0] != extents[run[-1]][0] + len(extents[run[-1]][1])):
            total = preadv_all(fd, [extents[r][1] for r in run], extents[run[0]][0])
            for r in run:
                got[r] = max(min(total, len(extents[r][1])), 0)
                total -= len(extents[r][1])
            run = []
        if j >= 0:
            run.append(j)
    return got
