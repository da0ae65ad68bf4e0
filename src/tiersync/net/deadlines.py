"""One deadline per key, the due ones found without a scan of those still running.

A server keeps a deadline for each of many things: a connection's handshake, a frame begun and
not finished, a parked session, a lease. :class:`Deadlines` maps each key to its deadline and a
value, and :meth:`Deadlines.due` takes out the keys whose deadline has passed, soonest first.
It is a dict beside a heap: replacing or dropping a key leaves its old heap entry behind, to be
skipped when it comes up; once such stale entries outnumber the live ones (plus a slack) the
heap is rebuilt from the live ones, so it never holds much more than twice the live count.

Not thread-safe: its owner locks, or uses it from one thread.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["Deadlines"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
_SLACK = 64  # stale heap entries kept beyond the live count before the heap is rebuilt


class Deadlines(Generic[K, V]):
    """Keys, each with a deadline (``time.monotonic`` or the owner's clock) and a value."""

    def __init__(self) -> None:
        self._live: dict[K, tuple[float, int, V]] = {}  # key -> (deadline, tie, value)
        self._heap: list[tuple[float, int, K]] = []  # (deadline, tie, key): the tie says which set it
        self._ties = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: object) -> bool:
        return key in self._live

    def keys(self) -> list[K]:
        return list(self._live)

    def get(self, key: K) -> V | None:
        held = self._live.get(key)
        return None if held is None else held[2]

    def set(self, key: K, deadline: float, value: V) -> None:
        """Give ``key`` this deadline and value (in place of any it had)."""
        tie = next(self._ties)
        self._live[key] = (deadline, tie, value)
        heapq.heappush(self._heap, (deadline, tie, key))
        if len(self._heap) > 2 * len(self._live) + _SLACK:
            self._heap = [(d, t, k) for k, (d, t, _) in self._live.items()]
            heapq.heapify(self._heap)

    def pop(self, key: K) -> V | None:
        """Drop ``key``; its value, None when it had none."""
        held = self._live.pop(key, None)
        return None if held is None else held[2]

    def first(self) -> tuple[K, float] | None:
        """The key with the soonest deadline, and that deadline (kept); None when there is none."""
        while self._heap and not self._current(self._heap[0]):
            heapq.heappop(self._heap)
        return (self._heap[0][2], self._heap[0][0]) if self._heap else None

    def due(self, now: float) -> list[tuple[K, V]]:
        """Take out every key whose deadline is ``now`` or earlier, soonest first, with its value."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            entry = heapq.heappop(self._heap)
            if self._current(entry):
                out.append((entry[2], self._live.pop(entry[2])[2]))
        return out

    def _current(self, entry: tuple[float, int, K]) -> bool:
        held = self._live.get(entry[2])
        return held is not None and held[1] == entry[1]
