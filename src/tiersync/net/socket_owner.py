"""Whether a process holds the other end of a TCP connection of ours (Linux ``/proc``).

A same-host server tells its pid in the handshake, and a client reads that process's memory
(``process_vm_readv``, or a map of its memfd): a pid taken on the peer's word could name any
process of this user, this one included. :func:`holds_peer_end` checks it against the
kernel's tables instead: the socket whose local address is our peer's and whose remote
address is ours (``/proc/net/tcp``, ``tcp6``) must be among that process's descriptors
(``/proc/<pid>/fd``, readable where ``process_vm_readv`` would be allowed).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import sys

from tiersync.net.local import LocalReadError

__all__ = ["holds_peer_end", "not_held"]

log = logging.getLogger(__name__)


def not_held(pid: int, sock: socket.socket, peer: str) -> LocalReadError | None:
    """None when ``pid`` holds the far end of ``sock``; else the refusal to read it (logged)."""
    if holds_peer_end(pid, sock):
        return None
    log.warning("%s names pid %d, which does not hold this connection: no same-host reads of it", peer, pid)
    return LocalReadError(f"pid {pid} does not hold this connection (a proxy, or a false pid)", peer=peer)


def holds_peer_end(pid: int, sock: socket.socket) -> bool:
    """True when process ``pid`` has open the far end of TCP socket ``sock``; False when it has
    not, or when this cannot be told (no such tables, the process gone or not ours to read)."""
    try:
        inode = _inode(sock.getpeername()[:2], sock.getsockname()[:2], sock.family)
        if inode is None:
            return False
        target = f"socket:[{inode}]"
        fds = f"/proc/{pid}/fd"
        return any(_link(os.path.join(fds, fd)) == target for fd in os.listdir(fds))
    except (OSError, ValueError):
        return False


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def _inode(local: tuple[str, int], remote: tuple[str, int], family: int) -> int | None:
    """The inode of the socket from ``local`` to ``remote`` in this network namespace's table."""
    table = "/proc/net/tcp6" if family == socket.AF_INET6 else "/proc/net/tcp"
    with open(table, "rb") as f:
        text = f.read()  # one search in C: the table holds every socket, TIME_WAIT ones too
    at = text.find(f" {_hex(*local, family)} {_hex(*remote, family)} ".encode())
    if at < 0:
        return None
    fields = text[at : text.find(b"\n", at)].split()  # local, remote, state, ..., uid, timeout, inode
    return int(fields[8]) if len(fields) > 8 and fields[8] != b"0" else None


def _hex(host: str, port: int, family: int) -> str:
    """An address as the kernel's table writes it: each 32-bit word of the IP in host order, hex."""
    packed = ipaddress.ip_address(host.split("%")[0]).packed
    words = "".join(f"{int.from_bytes(packed[i : i + 4], sys.byteorder):08X}" for i in range(0, len(packed), 4))
    return f"{words}:{port:04X}"
