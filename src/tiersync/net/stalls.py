"""Sessions part-way through a frame: each has ``limit_s`` from its first byte to its last.

A server reads an idle session's bytes on its loop thread and parses them as they come. An
authenticated peer that sends part of a request and then nothing more would keep its
buffered bytes (up to ``max_meta_size``) and its connection slot for good: a few thousand of
them fill the server's ``max_connections`` and keep every new client out. :class:`Stalls`
remembers when each session's unfinished frame began (:meth:`Stalls.note` after every read
that leaves one; :meth:`Stalls.clear` once the session is handed to a worker or ends) and
names the sessions whose frame is still unfinished ``limit_s`` later (:meth:`Stalls.expired`);
the server ends those. A session idle between frames is no stall.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

from tiersync.net.deadlines import Deadlines

__all__ = ["Stalls"]

S = TypeVar("S", bound=Hashable)


class Stalls(Generic[S]):
    """Unfinished frames per session (loop thread only: not thread-safe)."""

    def __init__(self, limit_s: float) -> None:
        self._limit = limit_s
        self._due: Deadlines[S, None] = Deadlines()  # session -> when its unfinished frame is due

    def __len__(self) -> int:
        return len(self._due)

    def note(self, session: S, mid_frame: bool, now: float) -> None:
        """After a read of ``session``: ``mid_frame`` whether part of a frame waits for the rest."""
        if not mid_frame:
            self._due.pop(session)
        elif session not in self._due:
            self._due.set(session, now + self._limit, None)

    def clear(self, session: S) -> None:
        """``session`` went to a worker, or ended."""
        self._due.pop(session)

    def expired(self, now: float) -> list[S]:
        """The sessions whose unfinished frame began ``limit_s`` or more before ``now`` (forgotten)."""
        return [session for session, _ in self._due.due(now)]
