"""Same-host memory reads: one process copies ranges out of another with ``process_vm_readv``.

Two ends of a link on one host (same kernel boot, same pid namespace: :func:`host_identity`)
need not push bytes through a socket: the source says where a range is in its memory and
the reader copies it with one kernel copy (what UCX calls CMA). The kernel lets a process
read another of the same uid unless Yama's ``ptrace_scope`` is 1, where the source must opt
in (:func:`allow_readers`). Refused reads raise :class:`LocalReadError`, so callers fall back
to TCP. ctypes releases the GIL for the call.

Where the source's memory is a sealed memfd (:mod:`tiersync.tiers.shareable`), the reader may
instead map it (:mod:`tiersync.net.shared_maps`) and copy out of the map (``mapped``): the
kernel's copy goes page by page and ran at about half of memcpy on the 2-core VM.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import ipaddress
import os
import secrets
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import numpy as np

from tiersync.errors import RemoteError, UsageError
from tiersync.net.errors import RequestError
from tiersync.net.fields import ErrorCode

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "LocalReadError",
    "Mapped",
    "address_of",
    "allow_readers",
    "buffer_address",
    "can_read",
    "host_identity",
    "local_address",
    "read_remote",
    "read_summed",
    "read_summed_at",
    "refusal",
    "same_host",
]

IOV_MAX = 1024
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value
_IOVEC = np.dtype([("base", np.uint64), ("len", np.uint64)])
_libc = ctypes.CDLL(None, use_errno=True)
_readv = getattr(_libc, "process_vm_readv", None)
if _readv is not None:
    _readv.restype = ctypes.c_ssize_t
    _readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
try:
    from tiersync.net import _local as _native
except ImportError:  # pragma: no cover - built without a compiler: read_remote + a second pass
    _native = None  # type: ignore[assignment]  # an optional compiled module: mypy cannot type it "or None"


class LocalReadError(RemoteError):
    """This process may not (or cannot) read the other's memory; ``errno`` names why."""


def refusal(exc: Exception, peer: str) -> LocalReadError | None:
    """``exc`` as a refused same-host read: a copy the kernel refused, or a server's UNSUPPORTED
    answer to a same-host pull (it does not count the reader as on its host while the reader
    does, e.g. behind NAT); None for anything else. Route AUTO falls back to TCP on either."""
    if isinstance(exc, LocalReadError):
        return exc
    if isinstance(exc, RequestError) and exc.code is ErrorCode.UNSUPPORTED:
        return LocalReadError(exc.message, peer=peer)
    return None


@functools.cache
def host_identity() -> str:
    """Equal for two processes that are on one host by every measure a user would apply: the
    kernel's boot id (one machine), the pid namespace (pids mean the same processes) and the
    network namespace (a netns stands for another host, e.g. in tests). Unreadable /proc gives a
    random value (never same-host)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}/{os.readlink('/proc/self/ns/net')}"
    except OSError:
        return f"unknown-{secrets.token_hex(16)}"


def same_host(reported: str, peer_ip: str) -> bool:
    """Whether a peer is on this host: it reported this host's identity (:func:`host_identity`)
    **and** its connection comes from an address of this host (:func:`local_address`). The
    identity alone is a string a peer can repeat: a remote
    peer that learned it (it travels in HELLO and READY) would otherwise be let read, and be
    read from, this host's processes."""
    return bool(reported) and reported == host_identity() and local_address(peer_ip)


def local_address(ip: str) -> bool:
    """Whether ``ip`` (as ``getpeername`` gives it) is an address of this host: loopback, or
    one the kernel routes to itself (a UDP ``connect`` picks it as its own source; no packet is
    sent, and unlike a ``bind`` test it holds with ``ip_nonlocal_bind``). A link-local IPv6
    address (its scope is not in the string) counts as not local: the safe side."""
    ip = ip[7:] if ip.startswith("::ffff:") and "." in ip else ip  # IPv4 on a dual-stack socket
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return False
    if addr.is_loopback:
        return True
    if addr.is_unspecified or addr.is_link_local:
        return False
    try:
        with socket.socket(socket.AF_INET6 if addr.version == 6 else socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))
            return ipaddress.ip_address(s.getsockname()[0]) == addr
    except OSError:
        return False


def buffer_address(buf: object) -> tuple[int, int]:
    """(address, nbytes) of a C-contiguous buffer (read-only ones too). UsageError otherwise."""
    try:
        view = memoryview(cast("Buffer", buf))
    except TypeError:
        raise UsageError("must support the buffer protocol", argument="buffer") from None
    if not view.c_contiguous:
        raise UsageError("must be C-contiguous", argument="buffer")
    if view.nbytes == 0:
        return 0, 0
    if _native is not None:
        return _native.address(view), view.nbytes
    return int(np.frombuffer(view.cast("B"), np.uint8).ctypes.data), view.nbytes


def address_of(view: memoryview) -> int:
    """Where a C-contiguous buffer's bytes start (BufferError otherwise): :func:`buffer_address`
    without its checks, for a block server's own views."""
    if _native is not None:
        return _native.address(view)
    return buffer_address(view)[0]


_allowed_in = [0]  # the pid whose readers are allowed (a forked child is another tracee: it asks again)


def allow_readers() -> None:
    """Let same-uid processes read this one where Yama's ptrace_scope is 1 (elsewhere they
    already may): ``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)``, once per process (a server
    calls this at every same-host read). Idempotent, never raises."""
    pid = os.getpid()
    if _allowed_in[0] == pid:
        return
    try:
        _libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(_PR_SET_PTRACER_ANY), 0, 0, 0)
    except (AttributeError, OSError):  # pragma: no cover - no prctl
        pass
    _allowed_in[0] = pid


def can_read(pid: int) -> bool:
    """True when this process may read ``pid``'s memory (a zero-length read is checked)."""
    if _readv is None:
        return False
    iov = np.zeros(1, _IOVEC)
    rc: int = _readv(pid, iov.ctypes.data, 1, iov.ctypes.data, 1, 0)
    return rc == 0


def _iovecs(regions: Sequence[tuple[int, int]] | np.ndarray) -> np.ndarray:
    arr = np.array(regions, dtype=np.uint64).reshape(-1, 2) if len(regions) else np.zeros((0, 2), np.uint64)
    out = np.empty(len(arr), _IOVEC)
    out["base"], out["len"] = arr[:, 0], arr[:, 1]
    return out[out["len"] > 0]


def _advance(iov: np.ndarray, n: int) -> np.ndarray:
    """``iov`` without its first ``n`` bytes."""
    ends = np.cumsum(iov["len"], dtype=np.uint64)
    k = int(np.searchsorted(ends, n, side="right"))
    rest = iov[k:].copy()
    if len(rest):
        done_before = int(ends[k - 1]) if k else 0
        cut = n - done_before
        rest["base"][0] += cut
        rest["len"][0] -= cut
    return rest


def read_remote(pid: int, remote: Sequence[tuple[int, int]] | np.ndarray, local: Sequence[memoryview]) -> None:
    """Copy the concatenated ``remote`` (address, length) regions of process ``pid`` into the
    concatenated writable ``local`` buffers (equal totals, else UsageError naming ``local``).
    LocalReadError when the kernel refuses (EPERM, ESRCH, EFAULT, ENOSYS) or the copy ends short."""
    src = _iovecs(remote)
    dst = _iovecs([_writable_address(b) for b in local])
    if int(src["len"].sum()) != int(dst["len"].sum()):
        raise UsageError(
            "local buffers must hold exactly the remote bytes",
            argument="local",
            remote=int(src["len"].sum()),
            local=int(dst["len"].sum()),
        )
    _copy(pid, src, dst)


def _writable_address(buf: object) -> tuple[int, int]:
    view = memoryview(cast("Buffer", buf))  # TypeError for anything else
    if view.readonly:
        raise UsageError("must be writable", argument="local")
    return buffer_address(view)


def _copy(pid: int, src: np.ndarray, dst: np.ndarray) -> None:
    if _readv is None:
        raise LocalReadError("process_vm_readv is not available", pid=pid, errno="ENOSYS")
    while len(src) and len(dst):
        ns, nd = min(len(src), IOV_MAX), min(len(dst), IOV_MAX)
        want = min(int(src["len"][:ns].sum()), int(dst["len"][:nd].sum()))
        got = _readv(pid, dst.ctypes.data, nd, src.ctypes.data, ns, 0)
        if got < 0:
            code = ctypes.get_errno()
            raise LocalReadError(
                f"process_vm_readv failed: {os.strerror(code)}", pid=pid, errno=errno.errorcode.get(code, code)
            )
        if got == 0 and want:
            raise LocalReadError("process_vm_readv copied nothing", pid=pid, errno="EFAULT")
        src, dst = _advance(src, got), _advance(dst, got)


Mapped = tuple[memoryview, int]  # a map of another process's memory, and the address its first byte has there


def read_summed(
    pid: int,
    remote: Sequence[tuple[int, int]] | np.ndarray,
    local: Sequence[memoryview],
    threads: int,
    mapped: Mapped | None = None,
) -> Sequence[int] | None:
    """:func:`read_remote` range by range (``local[i]`` exactly as long as ``remote[i]``; ``remote``
    (address, length) pairs or an (n, 2) uint64 array) on up to ``threads`` threads, returning
    the tsum64 of each landed range, summed while in cache (native ``_local``); copied out of
    ``mapped`` (:meth:`~tiersync.net.shared_maps.SharedMaps.map`) and summed in the same pass
    when given, every range checked to lie in it first. None when the native reader is not
    built (nothing was copied)."""
    if _native is None:
        return None
    if len(remote) != len(local):
        raise UsageError("one local buffer per remote range", argument="local")
    pairs = np.ascontiguousarray(remote, dtype=np.uint64).reshape(-1, 2) if len(remote) else np.zeros((0, 2), np.uint64)
    try:
        if mapped is not None:
            return _native.read_summed(pid, pairs.tobytes(), list(local), threads, *mapped)
        return _native.read_summed(pid, pairs.tobytes(), list(local), threads)
    except ValueError as exc:
        raise UsageError(str(exc), argument="local") from None
    except OSError as exc:
        raise _refused(pid, exc) from None


def read_summed_at(
    pid: int, remote: np.ndarray, dest: np.ndarray, offsets: np.ndarray, threads: int, mapped: Mapped | None = None
) -> Sequence[int] | None:
    """:func:`read_summed` into one writable uint8 array: range ``i`` of ``remote`` (an (n, 2)
    array of (address, length)) lands at ``dest[offsets[i]:]``, no Python object per range.
    UsageError naming ``offsets`` when a range would not fit in ``dest`` (or lie outside
    ``mapped``); None when the native reader is not built (nothing was copied)."""
    if _native is None:
        return None
    pairs = np.ascontiguousarray(remote, dtype=np.uint64).reshape(-1, 2)
    offs = np.ascontiguousarray(offsets, dtype=np.uint64).reshape(-1)
    try:
        if mapped is not None:
            return _native.read_summed_at(pid, pairs.tobytes(), dest, offs.tobytes(), threads, *mapped)
        return _native.read_summed_at(pid, pairs.tobytes(), dest, offs.tobytes(), threads)
    except ValueError as exc:
        raise UsageError(str(exc), argument="offsets") from None
    except OSError as exc:
        raise _refused(pid, exc) from None


def _refused(pid: int, exc: OSError) -> LocalReadError:
    code = exc.errno or 0
    return LocalReadError(
        f"process_vm_readv failed: {os.strerror(code)}", pid=pid, errno=errno.errorcode.get(code, code)
    )


def sum_ranges(
    buf: np.ndarray, offsets: Sequence[int], lengths: Sequence[int], threads: int = 1, states: np.ndarray | None = None
) -> list[int]:
    """tsum64 of each ``(offset, length)`` range of the uint8 array ``buf`` in one GIL-free call
    on up to ``threads`` threads (what a same-host source sends with a LOCAL_REPLY); a Python
    loop where the native reader is not built. ``states``: a C-contiguous uint64 array of 17
    per range that receives each range's partial state (``kernel.tsum64_partial``'s bytes), so
    runs of ranges compose (``kernel.tsum64_compose``) without reading them again."""
    if _native is None:
        from tiersync.transfer import kernel

        views = [buf[o : o + n].data for o, n in zip(offsets, lengths)]
        if states is not None:
            states.reshape(-1)[:] = np.frombuffer(b"".join(kernel.tsum64_partial(v) for v in views), np.uint64)
        return [kernel.tsum64(v) for v in views]
    pairs = np.stack([np.asarray(offsets, np.uint64), np.asarray(lengths, np.uint64)], axis=1)
    if states is None:
        return list(_native.sum_ranges(buf, pairs.tobytes(), threads))
    return list(_native.sum_ranges(buf, pairs.tobytes(), threads, states))
