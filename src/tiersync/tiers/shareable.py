"""Anonymous memory other processes of this host can map: a sealed ``memfd``.

A host arena that same-host readers copy out of (a store node's, a block server's) lives in a
``memfd`` mapped ``MAP_SHARED`` by its owner, then sealed: against shrinking and growing
(``F_SEAL_SHRINK``, ``F_SEAL_GROW``: a reader's map of a file that cannot shrink does not fault
with SIGBUS), against any further writable use (``F_SEAL_FUTURE_WRITE``, Linux 5.1+: the
owner's own writable map stays the only one, although any process of the same user may open
``/proc/<pid>/fd/<fd>``), and against more seals (``F_SEAL_SEAL``). A reader maps it read-only
(:mod:`tiersync.net.shared_maps`) and copies at memory speed instead of through the kernel's
page-by-page ``process_vm_readv``. :class:`SharedRegion` is what the owner tells readers:
which fd, and which addresses it backs.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from tiersync.errors import CapacityError, UsageError
from tiersync.tiers.huge_pages import HUGE_PAGE
from tiersync.tiers.madvise import madvise
from tiersync.tiers.prefault import MADV_POPULATE_WRITE

__all__ = [
    "NEEDED_SEALS",
    "SEALS",
    "SharedRegion",
    "check_shared",
    "covering",
    "open_shareable",
    "share_all",
    "share_in_place",
]

_SHRINK, _GROW = getattr(fcntl, "F_SEAL_SHRINK", 0x2), getattr(fcntl, "F_SEAL_GROW", 0x4)
_FUTURE_WRITE, _SEAL = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10), getattr(fcntl, "F_SEAL_SEAL", 0x1)
NEEDED_SEALS = _SHRINK
"""What a reader insists on before it maps a peer's memfd: it cannot shrink under the map."""
SEALS = _SHRINK | _GROW | _FUTURE_WRITE | _SEAL
"""The seals a shareable memfd carries (applied once its owner has mapped it writable)."""


@dataclass(frozen=True, slots=True)
class SharedRegion:
    """Addresses ``[address, address + nbytes)`` of this process are file descriptor ``fd``
    (a sealed memfd) from file offset ``offset`` on."""

    fd: int
    address: int
    nbytes: int
    offset: int = 0

    def covers(self, start: int, end: int) -> bool:
        """True when ``[start, end)`` lies inside the region."""
        return self.address <= start and end <= self.address + self.nbytes


def open_shareable(nbytes: int, name: str = "tiersync-arena") -> tuple[int, mmap.mmap]:
    """A sealed memfd of ``nbytes`` bytes and its owner's shared writable mapping (pages
    faulted lazily). CapacityError when it cannot be made (no memfd, more than this machine's
    memory: a memfd reserves nothing, so the size is checked here, as an anonymous map's is)."""
    fd, m = -1, None
    try:
        if nbytes > os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"):
            raise OSError(12, "more than the machine's physical memory")
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, nbytes)
        m = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        if not _sealed(fd):
            raise OSError(22, "the memfd could not be sealed")
        return fd, m
    except (OSError, OverflowError, AttributeError, ValueError) as exc:
        if m is not None:
            m.close()
        if fd >= 0:
            os.close(fd)
        raise CapacityError(
            "shareable host memory could not be made", argument="num_blocks", requested=nbytes, error=str(exc)
        ) from None


def share_in_place(buffer: object, argument: str = "buffer", name: str = "tiersync-shared") -> SharedRegion | None:
    """Back the whole pages of ``buffer`` (this process's writable memory, such as an engine's
    KV tensor) by a new sealed memfd, contents unchanged, so same-host readers may map them
    (:mod:`tiersync.net.shared_maps`) instead of copying through the kernel. The pages keep
    their addresses: the buffer stays the same memory for its owner (a child forked later
    shares the pages instead of copying them on write). Nothing may write the buffer meanwhile:
    each piece is copied into the memfd, then mapped over itself (``MAP_FIXED``). The partial
    pages at either end, which other memory may share, stay as they were; so does memory that
    is not private anonymous (a file's, or one already shared). The memfd holds the pages at
    offsets congruent to their addresses modulo 2 MiB, so the kernel can still give them huge
    pages (:class:`~tiersync.tiers.huge_pages.Collapser`). Returns the region,
    whose ``fd`` the caller closes once readers should stop mapping it (the memory stays); None
    where it cannot be done (no whole page, not Linux, no memfd): then nothing changed unless a
    piece's map failed midway, which leaves the pages before it backed by the memfd, same bytes
    (on kernels before 6.12 an ENOMEM inside ``mmap`` itself may leave that piece unmapped: call
    it where memory is not short, as an engine's start is). UsageError naming ``argument`` for
    anything but a writable C-contiguous buffer."""
    view = _writable(buffer, argument)
    first, page = view.ctypes.data, mmap.PAGESIZE
    start, end = -(-first // page) * page, (first + view.nbytes) // page * page
    if end <= start or not hasattr(os, "memfd_create") or not _private_anonymous(start, end):
        return None
    pad = start % HUGE_PAGE  # file offsets congruent to addresses: huge pages stay possible
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError:
        return None
    try:
        os.ftruncate(fd, pad + end - start)
        _map_over(fd, view[start - first : end - first], start, pad)
    except OSError:
        os.close(fd)
        return None
    if not _sealed(fd):  # readers map only a memfd that cannot shrink
        os.close(fd)
        return None
    return SharedRegion(fd, start, end - start, pad)


def _private_anonymous(start: int, end: int) -> bool:
    """Every mapping of ``[start, end)`` is private anonymous memory (not a file, not memory
    already shared with another process, not the brk heap or a stack, whose pages the
    allocator hands on to other objects), as an engine's large tensors are."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                low, high = (int(x, 16) for x in fields[0].split("-"))
                path = fields[5].strip() if len(fields) > 5 else ""
                own = not path or path.startswith("[anon:")
                if low < end and start < high and (fields[1][3] != "p" or not own):
                    return False
    except OSError:
        return False
    return True


def share_all(buffers: Sequence[object], argument: str = "buffers") -> tuple[SharedRegion, ...]:
    """:func:`share_in_place` for each of ``buffers`` whose memory no earlier one's region
    overlaps (views of one tensor are shared once); the regions made. All buffers are checked
    first (UsageError naming ``argument[i]``)."""
    views = [_writable(b, f"{argument}[{i}]") for i, b in enumerate(buffers)]
    out: list[SharedRegion] = []
    for view in sorted(views, key=lambda v: -v.nbytes):  # a tensor before the views inside it
        first, last = view.ctypes.data, view.ctypes.data + view.nbytes
        if any(r.address < last and first < r.address + r.nbytes for r in out):
            continue
        region = share_in_place(view)
        if region is not None:
            out.append(region)
    return tuple(out)


def check_shared(shared: Iterable[SharedRegion], argument: str = "shared") -> tuple[SharedRegion, ...]:
    """``shared`` as a tuple; UsageError naming ``argument`` unless every item is a SharedRegion."""
    out = tuple(shared) if not isinstance(shared, (str, bytes)) else (shared,)
    if not all(isinstance(r, SharedRegion) for r in out):
        raise UsageError("must be SharedRegions (HostArena.shared, share_in_place)", argument=argument)
    return out


def covering(shared: Iterable[SharedRegion], regions: np.ndarray) -> tuple[int, int, int, int] | None:
    """The region of ``shared`` that holds the most ``(address, length, ...)`` rows of
    ``regions``, as LOCAL_REPLY names it (``(fd, address, nbytes, offset)``: a reader copies
    the rows inside it out of a map, the others with ``process_vm_readv``), or None when none
    holds one."""
    if not len(regions):
        return None
    starts = regions[:, 0]
    ends = starts + regions[:, 1]
    low, high = int(starts.min()), int(ends.max())
    best, most = None, 0
    for r in shared:
        if r.address < high and low < r.address + r.nbytes:
            held = int(np.count_nonzero((starts >= r.address) & (ends <= r.address + r.nbytes)))
            best, most = (r, held) if held > most else (best, most)
    return None if best is None else (best.fd, best.address, best.nbytes, best.offset)


def _sealed(fd: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except OSError:  # a kernel before 5.1 lacks F_SEAL_FUTURE_WRITE: the others still hold
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS & ~_FUTURE_WRITE)
        except OSError:
            return False
    return True


def _writable(buffer: object, argument: str) -> np.ndarray:
    try:
        view: np.ndarray = np.frombuffer(buffer, np.uint8)  # type: ignore[call-overload]
    except (TypeError, ValueError, BufferError) as exc:
        raise UsageError("must be a C-contiguous buffer", argument=argument, reason=str(exc)) from None
    if not view.flags.writeable:
        raise UsageError("must be writable memory", argument=argument)
    return view


_PIECE = 64 << 20  # bytes copied and mapped at a time: the memory both hold at once
_MAP_FIXED = 0x10  # sys/mman.h


def _map_over(fd: int, pages: np.ndarray, start: int, pad: int) -> None:
    """Copy each piece of ``pages`` (this process's memory from address ``start``, whole
    pages) into ``fd`` at its offset plus ``pad`` and map that part of ``fd`` over it, shared
    and writable. An all-zero piece (a freshly zeroed KV cache) is not copied: the file's hole
    reads as zeros, and its pages are allocated in place (``MADV_POPULATE_WRITE``, Linux 5.14+;
    else on first touch). OSError at the first failure."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED
    for off in range(0, pages.nbytes, _PIECE):
        n = min(_PIECE, pages.nbytes - off)
        hole = not pages[off : off + n].view(np.uint64).any()  # a hole reads as zeros
        done = n if hole else 0
        while done < n:
            wrote = os.pwrite(fd, pages[off + done : off + n].data, pad + off + done)
            if wrote <= 0:
                raise OSError(5, "the memfd took no bytes")
            done += wrote
        if libc.mmap(start + off, n, prot, flags, fd, pad + off) != start + off:
            raise OSError(ctypes.get_errno(), "mmap over the buffer failed")
        if hole:  # resident, as the zeroed pages were: the owner's first writes do not fault
            madvise(start + off, n, MADV_POPULATE_WRITE)
