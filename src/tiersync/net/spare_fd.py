"""A descriptor kept in reserve for the connections a server dials itself.

Connections it accepts can fill a server's descriptor table (a flood of peers, up to
RLIMIT_NOFILE): the server then ends connections still in their handshake to accept new ones,
but a store node also dials the writer of every OFFER, and that dial would fail EMFILE for as
long as the flood lasts. :class:`SpareDescriptor` holds one descriptor (``/dev/null``) from the
start; a call that fails for lack of a descriptor gives it up and runs once more, so the socket
it opens takes its number (unless another thread opens one first: the call then fails as it
would have). The spare is opened again at the next call once a descriptor is free.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["SpareDescriptor"]

_T = TypeVar("_T")
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE)


class SpareDescriptor:
    """One descriptor in reserve (see the module docstring). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._closed = False
        self._refill()

    def call(self, open_one: Callable[[], _T]) -> _T:
        """``open_one()``; when it fails for lack of a descriptor (EMFILE or ENFILE, raised or the
        cause of what it raised), once more with the spare given up for it. Such second tries
        run one at a time (a first try never waits for them: the spare is taken back only when
        no second try holds it)."""
        if self._fd is None and self._lock.acquire(blocking=False):
            try:
                self._refill()
            finally:
                self._lock.release()
        try:
            return open_one()
        except Exception as exc:
            if not _out_of_fds(exc):
                raise
            with self._lock:
                if self._fd is None:
                    raise
                os.close(self._fd)
                self._fd = None
                return open_one()

    def close(self) -> None:
        """Give the spare back for good (idempotent)."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
            self._fd, self._closed = None, True

    @property
    def held(self) -> bool:
        """Whether the spare is open now."""
        with self._lock:
            return self._fd is not None

    def _refill(self) -> None:
        if self._fd is None and not self._closed:
            try:
                self._fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:  # none free now: the next call tries again
                pass


def _out_of_fds(exc: BaseException | None) -> bool:
    """Whether ``exc``, or an exception it was raised from, is EMFILE or ENFILE."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in _OUT_OF_FDS:
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False
