"""Ending the upstream calls of a client that hung up.

A non-streamed answer reaches the client only once it is whole, so nothing the router writes
fails when the client leaves meanwhile: without a watch, the engine computes an answer nobody
reads (a long prompt's prefill, say). :class:`Hangups` watches the clients'
sockets on one thread (epoll, ``EPOLLRDHUP``: the client closed or shut down its side; data it
sends, such as a pipelined next request, is no hangup) and fires the :class:`Hangup` of each
one that left: the upstream connections made for it through :func:`opener` are shut down, so
vLLM's server sees its client gone and aborts the request, and the router's wait ends. Where
epoll is missing nothing is watched and nothing fires.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import select
import socket
import ssl
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

__all__ = ["Hangup", "Hangups", "opener"]

_EVENTS = getattr(select, "EPOLLRDHUP", 0) | getattr(select, "EPOLLHUP", 0) | getattr(select, "EPOLLERR", 0)


class Hangup:
    """One client's: whether it left, and the upstream sockets to end when it does."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self.fired = False

    def attach(self, sock: socket.socket) -> None:
        """An upstream connection's socket, now connected: shut down at once if the client left."""
        with self._lock:
            self._socks.append(sock)
            fired = self.fired
        if fired:
            _shut(sock)

    def fire(self) -> None:
        with self._lock:
            self.fired, socks, self._socks = True, self._socks, []
        for sock in socks:
            _shut(sock)


def _left(fd: int) -> bool:
    """The client of ``fd`` closed or shut down its side, or its connection broke, now."""
    p = select.poll()
    p.register(fd, getattr(select, "POLLRDHUP", 0) | select.POLLHUP | select.POLLERR)
    return bool(p.poll(0))


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # closed meanwhile: the call is over anyway
        socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the TCP connection: an SSLSocket's own
        # shutdown would also unwrap it under the thread reading it (ValueError there)


class Hangups:
    """Watches client sockets on one daemon thread, started with the first watch."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: dict[int, Hangup] = {}
        self._poll: Any = None
        self._closed = False

    @contextlib.contextmanager
    def watch(self, sock: socket.socket) -> Iterator[Hangup]:
        """A Hangup fired if the client of ``sock`` leaves before the block ends."""
        hangup, fd = Hangup(), sock.fileno()
        if not self._register(fd, hangup):
            yield hangup
            return
        try:
            yield hangup
        finally:
            with self._lock:
                self._watched.pop(fd, None)
                if not self._closed:
                    with contextlib.suppress(OSError):
                        self._poll.unregister(fd)

    def _register(self, fd: int, hangup: Hangup) -> bool:
        with self._lock:
            if self._closed or not _EVENTS or not hasattr(select, "epoll"):
                return False
            if self._poll is None:
                self._poll = select.epoll()
                threading.Thread(target=self._run, args=(self._poll,), name="router-hangups", daemon=True).start()
            self._watched[fd] = hangup
            self._poll.register(fd, _EVENTS | select.EPOLLONESHOT)
            return True

    def _run(self, poll: Any) -> None:
        while True:
            try:
                ready = poll.poll(1.0)
            except (OSError, ValueError):  # closed
                return
            for fd, _ in ready:
                with self._lock:
                    hangup = self._watched.get(fd)
                    if hangup is None:
                        continue
                    if not _left(fd):  # an event of the fd's previous client: watch this one on
                        poll.modify(fd, _EVENTS | select.EPOLLONESHOT)
                        continue
                    del self._watched[fd]
                hangup.fire()

    def close(self) -> None:
        with self._lock:
            self._closed, poll = True, self._poll
            self._watched.clear()
        if poll is not None:
            poll.close()


def _attaching(base: type[http.client.HTTPConnection]) -> Any:
    """``base`` whose socket, once connected, is attached to the request's :class:`Hangup`."""

    class Attached(base):  # type: ignore[valid-type,misc]
        def __init__(self, hangup: Hangup | None, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._hangup = hangup

        def connect(self) -> None:
            super().connect()
            if self._hangup is not None:
                self._hangup.attach(self.sock)

    return Attached


_Conn, _TlsConn = _attaching(http.client.HTTPConnection), _attaching(http.client.HTTPSConnection)


class _Http(urllib.request.HTTPHandler):
    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_Conn, getattr(req, "hangup", None)), req)  # type: ignore[arg-type]


class _Https(urllib.request.HTTPSHandler):
    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        conn = functools.partial(_TlsConn, getattr(req, "hangup", None))
        return self.do_open(conn, req, context=self._context)  # type: ignore[arg-type,attr-defined]


def opener(context: ssl.SSLContext | None = None) -> urllib.request.OpenerDirector:
    """urllib's opener (proxies from the environment and all), whose connections for a
    request with a ``hangup`` attribute are attached to that :class:`Hangup`; ``context``
    verifies ``https://`` servers (None: the system's CAs)."""
    return urllib.request.build_opener(_Http(), _Https(context=context))
