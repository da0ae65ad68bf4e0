"""Reading an untrusted HTTP client's request within one deadline for the whole of it.

A socket timeout bounds each ``recv``, so a client that sends one byte a little more often
than that holds its connection (and a server's slot) for as long as it likes; idle keep-alive
connections too. :class:`DeadlineReader` is the raw stream under a handler's ``rfile``: from
:meth:`~DeadlineReader.start` on, every read waits only for what is left of the deadline, then
raises TimeoutError (which :class:`http.server.BaseHTTPRequestHandler` answers by closing the
connection). Writes keep the socket's own timeout.
"""

from __future__ import annotations

import io
import socket

from tiersync.net.socket_io import Deadline

__all__ = ["DeadlineReader"]


class DeadlineReader(io.RawIOBase):
    """Reads ``sock`` until the deadline :meth:`start` set (none before); the socket's timeout
    is ``write_timeout_s`` again after each read."""

    def __init__(self, sock: socket.socket, write_timeout_s: float) -> None:
        super().__init__()
        self._sock, self._write_timeout_s = sock, write_timeout_s
        self._deadline: Deadline | None = None

    def start(self, seconds: float) -> None:
        """The request (line, headers and body) read from now on must arrive within ``seconds``."""
        self._deadline = Deadline(seconds, "the client")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        # NetTimeoutError, a TimeoutError, once the deadline passed
        left = self._write_timeout_s if self._deadline is None else self._deadline.remaining()
        self._sock.settimeout(min(left, self._write_timeout_s))
        try:
            return self._sock.recv_into(buffer)
        finally:
            self._sock.settimeout(self._write_timeout_s)
