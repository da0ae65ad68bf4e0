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
from dataclasses import dataclass

from tiersync.errors import CapacityError

__all__ = ["NEEDED_SEALS", "SEALS", "SharedRegion", "open_shareable"]

_SHRINK, _GROW = getattr(fcntl, "F_SEAL_SHRINK", 0x2), getattr(fcntl, "F_SEAL_GROW", 0x4)
_FUTURE_WRITE, _SEAL = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10), getattr(fcntl, "F_SEAL_SEAL", 0x1)
NEEDED_SEALS = _SHRINK
"""What a reader insists on before it maps a peer's memfd: it cannot shrink under the map."""
SEALS = _SHRINK | _GROW | _FUTURE_WRITE | _SEAL
"""The seals a shareable memfd carries (applied once its owner has mapped it writable)."""


@dataclass(frozen=True, slots=True)
class SharedRegion:
    """Addresses ``[address, address + nbytes)`` of this process are file descriptor ``fd``
    (a sealed memfd) from offset 0."""

    fd: int
    address: int
    nbytes: int

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
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        except OSError:  # a kernel before 5.1 lacks F_SEAL_FUTURE_WRITE: the others still hold
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS & ~_FUTURE_WRITE)
        return fd, m
    except (OSError, OverflowError, AttributeError, ValueError) as exc:
        if m is not None:
            m.close()
        if fd >= 0:
            os.close(fd)
        raise CapacityError(
            "shareable host memory could not be made", argument="num_blocks", requested=nbytes, error=str(exc)
        ) from None
