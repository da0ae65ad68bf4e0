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

import heapq
import itertools
from typing import Generic, TypeVar

__all__ = ["Stalls"]

S = TypeVar("S")
_SLACK = 64  # deadline entries of frames already finished kept before the heap is swept


class Stalls(Generic[S]):
    """Unfinished frames per session (loop thread only: not thread-safe)."""

    def __init__(self, limit_s: float) -> None:
        self._limit = limit_s
        self._due: dict[S, float] = {}  # session -> when its unfinished frame is due
        self._heap: list[tuple[float, int, S]] = []  # (deadline, order, session); stale ones skipped
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._due)

    def note(self, session: S, mid_frame: bool, now: float) -> None:
        """After a read of ``session``: ``mid_frame`` whether part of a frame waits for the rest."""
        if not mid_frame:
            self._due.pop(session, None)
            return
        if session in self._due:
            return
        self._due[session] = due = now + self._limit
        heapq.heappush(self._heap, (due, next(self._order), session))
        if len(self._heap) > 2 * len(self._due) + _SLACK:
            self._heap = [e for e in self._heap if self._due.get(e[2]) == e[0]]
            heapq.heapify(self._heap)

    def clear(self, session: S) -> None:
        """``session`` went to a worker, or ended."""
        self._due.pop(session, None)

    def expired(self, now: float) -> list[S]:
        """The sessions whose unfinished frame began ``limit_s`` or more before ``now`` (forgotten)."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            due, _, session = heapq.heappop(self._heap)
            if self._due.get(session) == due:  # still that frame
                del self._due[session]
                out.append(session)
        return out
