"""The baselines of ``tiersync bench h2h``: raw loopback sockets and one-thread memcpy.

The raw reference serves the same blocks as tiersync's server: a 24-byte request
``(block, offset, length)`` answered by ``sendall`` of those bytes (no framing, no checksum),
read by :class:`RawClient` with ``recv_into`` straight into the destination, one request at a
time or ``window`` in flight. :class:`Memcpy` is the same-host rows' baseline.
"""

from __future__ import annotations

import socket
import struct
import threading
from typing import Any

__all__ = ["Memcpy", "RawClient", "raw_accept", "tune"]

_REQ = struct.Struct("<QQQ")  # raw reference request: block index, offset, length
_BUF = 16 << 20


def raw_accept(listener: socket.socket, blocks: dict[int, memoryview]) -> None:
    while True:
        try:
            sock, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=_raw_serve, args=(sock, blocks), daemon=True).start()


def _raw_serve(sock: socket.socket, blocks: dict[int, memoryview]) -> None:
    tune(sock)
    req = bytearray(_REQ.size)
    with sock:
        while _recv_exact(sock, memoryview(req)):
            idx, off, length = _REQ.unpack(req)
            sock.sendall(blocks[idx][off : off + length])


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _BUF)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _BUF)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view``; False on EOF before the first byte, ConnectionError on EOF inside."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            if got == 0:
                return False
            raise ConnectionError("raw peer closed mid-message")
        got += n
    return True


class RawClient:
    """``streams`` raw sockets asking for blocks with a 24-byte request, answers read in place."""

    def __init__(self, port: int, size: int, streams: int, window: int = 1) -> None:
        self.size, self.window = size, window
        self.socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(streams)]
        for s in self.socks:
            tune(s)

    def pull(self, w: int, i: int, dest: memoryview) -> None:
        sock = self.socks[w]
        sock.sendall(_REQ.pack(self.size << 20 | i, 0, self.size))
        if not _recv_exact(sock, dest):
            raise ConnectionError("raw peer closed")

    def pull_window(self, w: int, idxs: list[int], dests: list[memoryview]) -> None:
        """Keep ``window`` requests in flight, answers read in order (the same pipelining as ours)."""
        sock, sent = self.socks[w], 0
        for j, dest in enumerate(dests):
            while sent < len(idxs) and sent < j + self.window:
                sock.sendall(_REQ.pack(self.size << 20 | idxs[sent], 0, self.size))
                sent += 1
            if not _recv_exact(sock, dest):
                raise ConnectionError("raw peer closed")

    def close(self) -> None:
        for s in self.socks:
            s.close()


class Memcpy:
    """The same-host baseline: one-thread ``np.copyto`` of the same number of bytes, one buffer."""

    window = 8

    def __init__(self, expected: list[bytes]) -> None:
        import numpy as np

        self._np = np
        self.src = self.buffer(sum(map(len, expected)))
        self.src[:] = np.frombuffer(b"".join(expected), np.uint8)
        self.dst = self.buffer(len(self.src))

    @staticmethod
    def buffer(nbytes: int) -> Any:
        """A page-aligned uint8 array (numpy's allocator: huge pages where the kernel allows)."""
        import numpy as np

        return np.zeros(nbytes, np.uint8)

    def pull_window(self, w: int, idxs: list[int], dests: list[memoryview]) -> None:
        self._np.copyto(self.dst, self.src)

    def close(self) -> None:
        pass
