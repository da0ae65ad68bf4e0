"""Eviction policies: which evictable blocks go first.

A policy tracks the ids of *evictable* blocks only. Its contract is small:
``add`` (became evictable), ``touch`` (used again), ``remove`` (no longer
evictable), and ``choose(n)`` which names exactly ``n`` victims or returns
``None`` and changes nothing — a policy never frees part of what it was asked.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Any, Generic, Protocol, TypeVar

from tiersync.errors import UsageError

K = TypeVar("K", bound=Hashable)  # the key type: host block ids (int), store keys (bytes)


class EvictionPolicy(Protocol[K]):
    def add(self, key: K) -> None: ...
    def touch(self, key: K) -> None: ...
    def remove(self, key: K) -> None: ...
    def choose(self, n: int) -> list[K] | None: ...
    def __len__(self) -> int: ...
    def __contains__(self, key: object) -> bool: ...


class LRUPolicy(Generic[K]):
    """Least recently used first. ``touch`` of an unknown key is ignored."""

    def __init__(self) -> None:
        self._order: OrderedDict[K, None] = OrderedDict()

    def add(self, key: K) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: K) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: K) -> None:
        self._order.pop(key, None)

    def choose(self, n: int) -> list[K] | None:
        if n > len(self._order):
            return None
        it = iter(self._order)
        return [next(it) for _ in range(n)]

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


class S3FIFOPolicy(Generic[K]):
    """Scan-resistant S3-FIFO: new keys enter a small FIFO; keys touched there move to
    the main FIFO; victims come from the small FIFO first (one-hit wonders), then main
    (with one second chance per touch). ``small_ratio`` sizes the small queue."""

    def __init__(self, small_ratio: float = 0.1) -> None:
        self._small: OrderedDict[K, int] = OrderedDict()
        self._main: OrderedDict[K, int] = OrderedDict()
        self._ratio = small_ratio

    def add(self, key: K) -> None:
        self.remove(key)
        self._small[key] = 0

    def touch(self, key: K) -> None:
        if key in self._small:
            self._small[key] = 1
        elif key in self._main:
            self._main[key] = min(self._main[key] + 1, 3)

    def remove(self, key: K) -> None:
        self._small.pop(key, None)
        self._main.pop(key, None)

    def choose(self, n: int) -> list[K] | None:
        if n > len(self):
            return None
        small, main = OrderedDict(self._small), OrderedDict(self._main)  # dry run; commit nothing
        victims: list[K] = []
        while len(victims) < n:
            if small and (len(small) >= self._ratio * (len(small) + len(main)) or not main):
                key, freq = small.popitem(last=False)
                if freq:
                    main[key] = 0
                else:
                    victims.append(key)
                continue
            key, freq = main.popitem(last=False)
            if freq:
                main[key] = freq - 1
            else:
                victims.append(key)
        return victims

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def __contains__(self, key: object) -> bool:
        return key in self._small or key in self._main


POLICIES: dict[str, type[LRUPolicy[Any]] | type[S3FIFOPolicy[Any]]] = {"lru": LRUPolicy, "s3fifo": S3FIFOPolicy}
"""Every eviction policy by the name configs use (the one registry)."""


def check_policy(name: object, argument: str) -> str:
    """``name`` when it names a policy of :data:`POLICIES`; UsageError naming ``argument`` else."""
    if not isinstance(name, str) or name not in POLICIES:
        raise UsageError("unknown eviction policy", argument=argument, value=name, choices=sorted(POLICIES))
    return name
