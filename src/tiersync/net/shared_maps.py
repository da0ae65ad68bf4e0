"""Read-only maps of other processes' shareable memory, for same-host readers.

A same-host source whose memory is a sealed memfd (:mod:`tiersync.tiers.shareable`) names it in
LOCAL_REPLY: ``(fd, address, nbytes)``. :class:`SharedMaps` opens ``/proc/<pid>/fd/<fd>`` (the
kernel lets a process of the same user do so: a read-mode ptrace check, which Yama's
``ptrace_scope`` does not restrict, unlike ``process_vm_readv``'s), maps it read-only, and
hands out views the native reader copies from. The reply is a hint from a peer,
so nothing in it is trusted: only a regular file of normal pages (not hugetlbfs) sealed against
shrinking is mapped, since a file that cannot shrink cannot make a reader's access fault
(SIGBUS); anything else (a FIFO or device named to hang or disturb the reader, an unsealed
memfd, a descriptor not open) is refused and the caller reads with ``process_vm_readv``
instead; every range is checked against the map before it is copied and every copy is
verified against its checksum. A map stays open while its descriptor names the same file; one
whose descriptor was reused is dropped. Each map costs the reader page tables for what it
touched (no huge pages for shared memory on most kernels): about 2 MiB per GiB read.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
import threading

from tiersync.net.local import Mapped
from tiersync.tiers.shareable import NEEDED_SEALS

__all__ = ["SharedMaps"]

_Key = tuple[int, int, int, int]  # (pid, fd, st_dev, st_ino)
_OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY


class SharedMaps:
    """The maps one reader holds (at most :attr:`LIMIT`, oldest closed first). Thread-safe;
    after :meth:`close` nothing is mapped any more (:meth:`map` answers None)."""

    LIMIT = 128  # an engine's shared KV is one memfd per layer tensor: a whole model's stays mapped
    REFUSALS = 256  # files remembered as unmappable (then forgotten all at once)

    def __init__(self) -> None:
        self._maps: dict[_Key, mmap.mmap] = {}
        self._refused: set[_Key] = set()
        self._lock = threading.Lock()
        self._closed = False

    def map(self, pid: int, mapping: tuple[int, int, int]) -> Mapped | None:
        """``(view of the map, address)`` for ``pid``'s ``mapping`` = ``(fd, address, nbytes)`` as
        a LOCAL_REPLY names it, or None when it cannot (or may not) be mapped. The view keeps
        the map alive until it is released, whatever :meth:`close` does meanwhile."""
        fd, address, nbytes = mapping
        path = f"/proc/{pid}/fd/{fd}"
        try:
            st = os.stat(path)
        except (OSError, ValueError):
            return None
        if not stat.S_ISREG(st.st_mode):  # never open a FIFO or a device a peer names
            return None
        key = (pid, fd, st.st_dev, st.st_ino)
        with self._lock:
            if self._closed or key in self._refused:
                return None
            found = self._maps.get(key)
            if found is None:
                found = self._open(path, key)
                if found is None:
                    return None
            return (memoryview(found), address) if len(found) >= nbytes > 0 else None

    def _open(self, path: str, key: _Key) -> mmap.mmap | None:
        """Map ``path`` (lock held): drop maps of files that descriptor named before, refuse
        (and remember) what is not a sealed memfd, keep at most LIMIT maps."""
        for stale in [k for k in self._maps if k[:2] == key[:2]]:
            _unmap(self._maps.pop(stale))
        try:
            opened = _open_sealed(path, key)
        except OSError:  # transient (EMFILE, ENOMEM, the process went away): not remembered
            return None
        if opened is None:
            if len(self._refused) >= self.REFUSALS:
                self._refused.clear()
            self._refused.add(key)
            return None
        while len(self._maps) >= self.LIMIT:
            _unmap(self._maps.pop(next(iter(self._maps))))
        self._maps[key] = opened
        return opened

    def __len__(self) -> int:
        """Maps open now."""
        with self._lock:
            return len(self._maps)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            maps, self._maps = list(self._maps.values()), {}
        for m in maps:
            _unmap(m)


def _open_sealed(path: str, key: _Key) -> mmap.mmap | None:
    """``path`` mapped read-only, whole, when it is still ``key``'s file, a regular file of
    normal pages (hugetlbfs could fault a reader when its pool runs dry) and sealed against
    shrinking; None when it is not; OSError when it could not be looked at."""
    fd = os.open(path, _OPEN_FLAGS)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != key[2:] or not stat.S_ISREG(st.st_mode) or st.st_blksize != mmap.PAGESIZE:
            return None
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:  # EINVAL: not a memfd, so no seals
            return None
        if seals & NEEDED_SEALS != NEEDED_SEALS:
            return None
        try:  # length 0: the file's size now, which the seal keeps from shrinking
            return mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except ValueError:  # an empty file
            return None
    finally:
        os.close(fd)


def _unmap(m: mmap.mmap) -> None:
    try:
        m.close()
    except BufferError:  # a copy holds a view of it: unmapped when that view is released
        pass
