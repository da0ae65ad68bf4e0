"""Sessions whose request waits for something, without a worker: a handler's :class:`Park`.

A handler that cannot answer a request yet (a prefill rank's KV_NEXT for a layer still being
computed) answers :class:`~tiersync.net.service.Park` instead of blocking a pool worker for as
long as it waits: a few readers asking early would otherwise hold every worker, and every
other reader of the server would wait behind them. :class:`ParkedSessions` keeps such a
session, with its request, out of both the pool and the selector (its later requests wait
behind the parked one, answered in order), and hands it back to a worker (``resume``) with the
same request once, whichever comes first:

- the service's wake callback runs (``Park.watch`` gave it one; a late call from an older park
  of the same session is ignored: each park has its own token),
- the park's deadline passes (:meth:`ParkedSessions.expire`, from the server's loop, which
  runs at least once a second: the handler then answers that it timed out; a Park with
  ``late`` answers keeps its request's first deadline, and the server answers them once a
  request asked past it parks again),
- the session ends (:meth:`ParkedSessions.resume` without a token: the worker finds it closed
  and hands it back, so the server closes its socket). The server's loop ends a parked
  session whose peer hung up (a decode rank that died while its KV_NEXT waited), FIN or RST,
  within about a second, whatever bytes of later requests wait unread before it
  (:func:`~tiersync.net.socket_io.peer_gone`); a peer that only half-closed is taken as gone.

The handler is asked again from the start: it answers, or parks again.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from tiersync.net.deadlines import Deadlines
from tiersync.net.service import Park

__all__ = ["ParkedSessions"]

log = logging.getLogger(__name__)

S = TypeVar("S", bound=Hashable)


class ParkedSessions(Generic[S]):
    """Parked sessions; ``resume(session, request)`` hands one back to a worker (it must not
    raise: where no worker can take it, it ends the session and hands it back to the server)."""

    def __init__(self, resume: Callable[[S, object], object]) -> None:
        self._resume = resume
        self._lock = threading.Lock()
        self._parked: Deadlines[S, tuple[int, object]] = Deadlines()  # session -> (token, request)
        self._tokens = itertools.count(1)

    def __len__(self) -> int:
        with self._lock:
            return len(self._parked)

    def sessions(self) -> list[S]:
        """The sessions parked now."""
        with self._lock:
            return self._parked.keys()

    def park(self, session: S, request: object, park: Park) -> None:
        """Keep ``session`` until ``park`` wakes it, its deadline passes or the session ends.
        A ``watch`` that raises before it woke the session leaves it not parked and raises (the
        caller then ends the session); one that raises after is logged (the session is another
        worker's by then)."""
        token = next(self._tokens)
        with self._lock:
            self._parked.set(session, park.deadline, (token, request))
        try:
            park.watch(lambda: self.resume(session, token))
        except Exception:
            with self._lock:
                held = self._parked.get(session)
                mine = held is not None and held[0] == token
                if mine:
                    self._parked.pop(session)
            if mine:
                raise
            log.exception("a service's watch failed after it woke its session")

    def resume(self, session: S, token: int | None = None) -> bool:
        """Hand ``session`` back with its request, once; ``token``: only if it is still that
        park's (None: whichever). False when it was not parked (then nothing is done)."""
        with self._lock:
            held = self._parked.get(session)
            if held is None or token not in (None, held[0]):
                return False
            self._parked.pop(session)
        self._resume(session, held[1])
        return True

    def expire(self, now: float) -> None:
        """Resume every session whose park's deadline is ``now`` or earlier."""
        with self._lock:
            due = self._parked.due(now)  # taken out here: no wake can resume them too
        for session, (_, request) in due:
            self._resume(session, request)
