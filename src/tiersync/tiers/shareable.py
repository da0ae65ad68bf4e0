"""Anonymous memory other processes of this host can map: a sealed ``memfd``.

A host arena that same-host readers copy out of (a store node's, a block server's) lives in a
``memfd`` mapped ``MAP_SHARED``, sealed against shrinking and growing (``F_SEAL_SHRINK``,
``F_SEAL_GROW``, then ``F_SEAL_SEAL``). A reader allowed to read this process (the check
``process_vm_readv`` makes) opens ``/proc/<pid>/fd/<fd>`` and maps it read-only, then copies
at memory speed instead of through the kernel's page-by-page copy; the seals are what make
that safe for the reader: a mapping whose file cannot shrink never faults with SIGBUS.
:class:`SharedRegion` is what the owner tells readers: which fd, and which addresses it backs.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from dataclasses import dataclass

from tiersync.errors import CapacityError

__all__ = ["SEALS", "SharedRegion", "open_shareable"]

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
"""The seals a shareable memfd carries (a reader refuses one without ``F_SEAL_SHRINK``)."""


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
    """A sealed memfd of ``nbytes`` bytes and its shared writable mapping (pages faulted lazily).
    CapacityError when the kernel refuses (no memfd, ENOMEM)."""
    fd = -1
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        return fd, mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    except (OSError, OverflowError, AttributeError) as exc:
        if fd >= 0:
            os.close(fd)
        raise CapacityError(
            "shareable host memory could not be made", argument="num_blocks", requested=nbytes, error=str(exc)
        ) from None
