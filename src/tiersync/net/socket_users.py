"""Closing a socket that other threads may be using by its number.

A thread blocked in ``recv`` on a socket another thread closes would go on with that number:
the kernel may give it to the next file or connection opened, and the call then reads or
writes another peer's bytes. :class:`SocketUsers` counts the calls under way (:func:`in_use`);
its :meth:`~SocketUsers.close` shuts the socket down, which wakes them, and the last one out
closes it.
"""

from __future__ import annotations

import functools
import socket
import threading
from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar

from tiersync.net.errors import PeerClosedError

__all__ = ["SocketUsers", "in_use"]


class SocketUsers:
    """The calls that use a socket by its number. :meth:`close` from another thread shuts it
    down (which wakes them) and the last of them closes it, so its number never goes to
    another connection while a call may still read or write by it."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self._sock, self._peer, self._lock, self._count, self._closing = sock, peer, threading.Lock(), 0, False

    def __enter__(self) -> None:
        with self._lock:
            if self._closing:
                raise PeerClosedError("connection closed", peer=self._peer)
            self._count += 1

    def __exit__(self, *_exc: object) -> None:
        with self._lock:
            self._count -= 1
            last = self._closing and not self._count
        if last:
            self._sock.close()

    def close(self) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing, idle = True, not self._count
        try:  # the plain socket's shutdown: a TLS socket keeps its state until it is closed
            socket.socket.shutdown(self._sock, socket.SHUT_RDWR)
        except OSError:
            pass
        if idle:
            self._sock.close()


class _HasUsers(Protocol):
    _users: SocketUsers


P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T", bound=_HasUsers)


def in_use(method: Callable[Concatenate[T, P], R]) -> Callable[Concatenate[T, P], R]:
    """Run ``method`` of an object as one of its ``_users`` (a :class:`SocketUsers`)."""

    @functools.wraps(method)
    def run(self: T, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with self._users:
            return method(self, *args, **kwargs)

    return run
