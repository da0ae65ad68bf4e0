"""Read-only maps of other processes' shareable memory, for same-host readers.

A same-host source whose memory is a sealed memfd (:mod:`tiersync.tiers.shareable`) names it in
LOCAL_REPLY: ``(fd, address, nbytes, offset)``. :class:`SharedMaps` opens ``/proc/<pid>/fd/<fd>`` (the
kernel lets a process of the same user do so: a read-mode ptrace check, which Yama's
``ptrace_scope`` does not restrict, unlike ``process_vm_readv``'s), maps it read-only, and
hands out views the native reader copies from. The reply is a hint from a peer,
so nothing in it is trusted: only a regular file of normal pages (not hugetlbfs) sealed against
shrinking is mapped, since a file that cannot shrink cannot make a reader's access fault
(SIGBUS); anything else (a FIFO or device named to hang or disturb the reader, an unsealed
memfd, a descriptor not open) is refused and the caller reads with ``process_vm_readv``
instead; every range is checked against the map before it is copied and every copy is
verified against its checksum. A map stays open while its descriptor names the same file; one
whose descriptor was reused is dropped, and so is every map of a process that exited (its
pidfd, watched by one daemon thread: the map alone would keep a dead engine's whole KV cache
allocated). Each map costs the reader page tables for what it touched (no huge pages for
shared memory on most kernels): about 2 MiB per GiB read, once per process: the channels of
a process share one :func:`process_maps`.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import select
import stat
import threading
import weakref

from tiersync.net.local import Mapped
from tiersync.tiers.shareable import NEEDED_SEALS

__all__ = ["SharedMaps", "process_maps"]

_Key = tuple[int, int, int, int]  # (pid, fd, st_dev, st_ino)
_OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY


class SharedMaps:
    """The maps one reader holds (at most :attr:`LIMIT`, oldest closed first). Thread-safe;
    after :meth:`close` nothing is mapped any more (:meth:`map` answers None)."""

    LIMIT = 1024  # an engine's shared KV is one memfd per layer tensor: whole models stay mapped
    REFUSALS = 256  # files remembered as unmappable (then forgotten all at once)

    def __init__(self) -> None:
        self._maps: dict[_Key, mmap.mmap] = {}
        self._refused: set[_Key] = set()
        self._lock = threading.Lock()
        self._closed = False

    def map(self, pid: int, mapping: tuple[int, int, int, int]) -> Mapped | None:
        """``(view of the map, address of its first byte)`` for ``pid``'s ``mapping`` = ``(fd,
        address, nbytes, offset)`` as a LOCAL_REPLY names it, or None when it cannot (or may
        not) be mapped. The view keeps the map alive until it is released, whatever
        :meth:`close` does meanwhile."""
        fd, address, nbytes, offset = mapping
        if not 0 <= offset <= address or nbytes <= 0:
            return None
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
            found, new = self._maps.get(key), False
            if found is None:
                found, new = self._open(path, key), True
                if found is None:
                    return None
            got = (memoryview(found), address - offset) if len(found) >= offset + nbytes else None
        if new:
            _EXITS.watch(pid, self)
        return got

    def _open(self, path: str, key: _Key) -> mmap.mmap | None:
        """Map ``path`` (lock held): drop the process's maps of files its descriptors name no
        more (closed, or reused: a map would keep a closed memfd's memory allocated while the
        process lives on), refuse (and remember) what is not a sealed memfd, keep at most LIMIT
        maps."""
        for stale in [k for k in self._maps if k[0] == key[0] and (k[1] == key[1] or not _names(k))]:
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

    def forget(self, pid: int) -> None:
        """Process ``pid`` exited: drop its maps (their memory is freed once no view holds them)."""
        with self._lock:
            gone = [k for k in self._maps if k[0] == pid]
            maps = [self._maps.pop(k) for k in gone]
            self._refused = {k for k in self._refused if k[0] != pid}
        for m in maps:
            _unmap(m)

    def count(self, pid: int) -> int:
        """Maps of process ``pid``'s memory open now."""
        with self._lock:
            return sum(k[0] == pid for k in self._maps)

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


def _names(key: _Key) -> bool:
    """Process ``key[0]``'s descriptor ``key[1]`` still names the file ``key`` was made for."""
    try:
        st = os.stat(f"/proc/{key[0]}/fd/{key[1]}")
    except (OSError, ValueError):
        return False
    return (st.st_dev, st.st_ino) == key[2:]


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


class _Exits:
    """Tells each :class:`SharedMaps` when a process whose memory it maps exited: one daemon
    thread polls a pidfd per process (Linux 5.3+; elsewhere maps go only as they did before)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pids: dict[int, tuple[int, weakref.WeakSet[SharedMaps]]] = {}  # pid -> (pidfd, maps)
        self._wake: tuple[int, int] | None = None

    def watch(self, pid: int, maps: SharedMaps) -> None:
        with self._lock:
            if pid in self._pids:
                self._pids[pid][1].add(maps)
                return
            try:
                pidfd = os.pidfd_open(pid)
            except ProcessLookupError:
                pidfd = -1
            except (OSError, AttributeError):  # no pidfd here: maps go only as they did before
                return
            if pidfd >= 0:
                self._pids[pid] = (pidfd, weakref.WeakSet([maps]))
            if self._wake is None:
                self._wake = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
                threading.Thread(
                    target=self._run, args=(self._wake[0],), name="tiersync-map-exits", daemon=True
                ).start()
            with contextlib.suppress(BlockingIOError):  # a full pipe: the thread wakes anyway
                os.write(self._wake[1], b"w")
        if pidfd < 0:  # it exited before it was watched
            maps.forget(pid)

    def _run(self, wake: int) -> None:
        while True:
            poll = select.poll()
            poll.register(wake, select.POLLIN)
            with self._lock:
                by_fd = {pidfd: pid for pid, (pidfd, _) in self._pids.items()}
            for pidfd in by_fd:
                poll.register(pidfd, select.POLLIN)
            for fd, _ in poll.poll():
                if fd == wake:  # the set changed
                    with contextlib.suppress(BlockingIOError):
                        while os.read(wake, 4096):
                            pass
                    continue
                with self._lock:
                    pidfd, owners = self._pids.pop(by_fd[fd])
                os.close(pidfd)
                for owner in list(owners):
                    owner.forget(by_fd[fd])

    def forked(self) -> None:
        """In a child after fork: no thread, no pidfds of the parent's (its maps are its own)."""
        self._lock = threading.Lock()
        self._pids, self._wake = {}, None


_EXITS = _Exits()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_EXITS.forked)
_PROCESS: list[SharedMaps] = []  # the one process_maps()
_PROCESS_LOCK = threading.Lock()


def process_maps() -> SharedMaps:
    """The maps this process's channels share (made on first use, never closed)."""
    with _PROCESS_LOCK:
        if not _PROCESS:
            _PROCESS.append(SharedMaps())
        return _PROCESS[0]
