"""A server's accept path: bursts of ``accept``, and what it does when descriptors run out.

:class:`Acceptor` runs on the server's loop thread whenever its listener is readable. It
takes up to ``_ACCEPT_BURST`` connections (``admit`` decides each one's fate). ``accept``
failing for lack of descriptors (EMFILE, ENFILE) first makes room by ending a connection
still in its handshake (``make_room``); when there is none, and for ENOBUFS and ENOMEM, it
stops accepting for ``_ACCEPT_PAUSE_S`` (the listener leaves the selector; the backlog keeps
the peers), logs once while it lasts, and resumes (:meth:`Acceptor.resume_due`). Errors
``accept`` passes on for a connection that failed before it was taken are skipped. It
never ends the server.
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import time
from collections.abc import Callable

__all__ = ["Acceptor"]

log = logging.getLogger(__name__)
_FD_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
# accept(2): a connection that failed before it was taken, or the network errors Linux passes on
_RETRY_ERRNOS = tuple(
    getattr(errno, name)
    for name in ("ECONNABORTED", "EPROTO", "EPERM", "ENETDOWN", "ENOPROTOOPT", "EHOSTDOWN", "ENONET",
                 "EHOSTUNREACH", "EOPNOTSUPP", "ENETUNREACH")
    if hasattr(errno, name)
)  # fmt: skip
_ACCEPT_PAUSE_S = 0.1
_ACCEPT_BURST = 256
_GRACE_S = 0.25  # out of descriptors, a connection in its handshake is not ended for the next before this age


class Acceptor:
    """Accepts on ``listener`` (non-blocking, registered in ``sel``) for the server at
    ``address``; ``admit(sock, "ip:port")`` takes each connection (False: refused over the
    cap), ``make_room(grace_s)`` ends a connection in its handshake at least ``grace_s`` old
    (False when there is none)."""

    def __init__(
        self,
        listener: socket.socket,
        sel: selectors.BaseSelector,
        address: str,
        admit: Callable[[socket.socket, str], bool],
        make_room: Callable[[float], bool],
    ) -> None:
        self._listener, self._sel, self._address = listener, sel, address
        self._admit, self._make_room = admit, make_room
        self.paused_until = 0.0  # 0.0: accepting
        self._fd_logged = False

    def accept(self) -> None:
        for _ in range(_ACCEPT_BURST):
            try:
                sock, addr = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                # out of descriptors below the cap (a table smaller than max_connections): a
                # connection still in its handshake makes room, as at the cap, else wait a moment
                if exc.errno in (errno.EMFILE, errno.ENFILE) and self._make_room(_GRACE_S):
                    continue
                if exc.errno in _FD_ERRNOS:
                    return self._pause(exc)
                if exc.errno in _RETRY_ERRNOS:
                    continue
                raise
            if self._admit(sock, f"{addr[0]}:{addr[1]}"):
                self._fd_logged = False  # admitted below the cap: descriptors were there

    def resume_due(self, now: float) -> None:
        """Accept again once the pause is over (the loop calls this every turn)."""
        if self.paused_until and now >= self.paused_until:
            self.paused_until = 0.0
            self._sel.register(self._listener, selectors.EVENT_READ, None)

    def _pause(self, exc: OSError) -> None:
        if not self._fd_logged:
            log.warning(
                "tiersync server %s cannot accept (%s); retrying every %.1f s while it lasts",
                self._address,
                errno.errorcode.get(exc.errno or 0, exc.errno),
                _ACCEPT_PAUSE_S,
            )
            self._fd_logged = True
        self._sel.unregister(self._listener)
        self.paused_until = time.monotonic() + _ACCEPT_PAUSE_S
