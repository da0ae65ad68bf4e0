"""Pure bookkeeping of the KV cache store: entries, pins, residency and eviction order.

No bytes move here and nothing is thread-safe: :class:`~tiersync.store.kvstore.KVCacheStore`
calls it under its lock. Rules:

- An entry is *visible* (a lookup hit) when no save of it is in flight (``pending``)
  and it has a HOST or STORAGE copy.
- ``pins`` are the callers' pins (lookup adds one; load success and release take one);
  ``busy`` counts the store's own holds (a save, demotion or load in flight).
- Per tier, the eviction policy holds exactly the entries with a copy there, no pins,
  no holds and not pending. So a pinned or busy entry is never chosen for eviction.
- An entry with no copy anywhere, no pins, no holds and not pending is forgotten.
  A pinned entry that lost its copies (e.g. corrupt on disk) stays as a tombstone
  (invisible) until its pins are released, so the pin algebra stays exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tiersync.errors import UsageError
from tiersync.store.residency import LOADABLE, Residency

if TYPE_CHECKING:
    from tiersync.tiers.eviction import EvictionPolicy


@dataclass(slots=True, eq=False)
class Entry:
    key: bytes
    residency: Residency = Residency.NONE
    host_block: int | None = None
    pins: int = 0
    busy: int = 0
    pending: bool = False

    @property
    def visible(self) -> bool:
        return not self.pending and bool(self.residency & LOADABLE)

    @property
    def idle(self) -> bool:
        return self.pins == 0 and self.busy == 0 and not self.pending

    @property
    def block(self) -> int:
        """``host_block`` of an entry that holds one (a HOST copy, or a save in flight)."""
        assert self.host_block is not None, "entry holds no host block"
        return self.host_block


class PinIndex:
    """Entries by key with one eviction policy per tier (HOST, STORAGE)."""

    def __init__(self, host_policy: EvictionPolicy[bytes], storage_policy: EvictionPolicy[bytes]) -> None:
        self._entries: dict[bytes, Entry] = {}
        self._policy = {Residency.HOST: host_policy, Residency.STORAGE: storage_policy}
        self.counts = {Residency.HOST: 0, Residency.STORAGE: 0}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> Entry | None:
        return self._entries.get(key)

    def visible(self, key: bytes) -> Entry | None:
        e = self._entries.get(key)
        return e if e is not None and e.visible else None

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def evictable(self, tier: Residency) -> int:
        return len(self._policy[tier])

    # -- pins -----------------------------------------------------------------
    def pin(self, entries: Sequence[Entry]) -> None:
        for e in entries:
            e.pins += 1
            self._sync(e)

    def unpin(self, keys: Sequence[bytes], *, argument: str = "keys") -> list[Entry]:
        """Drop one pin per key (a key named twice drops two). All-or-nothing."""
        need: dict[bytes, int] = {}
        for k in keys:
            need[k] = need.get(k, 0) + 1
        for k, n in need.items():
            e = self._entries.get(k)
            if e is None or e.pins < n:
                raise UsageError(
                    "key is not pinned (release only what lookup returned)",
                    argument=argument,
                    key=k.hex(),
                    pins=0 if e is None else e.pins,
                    releasing=n,
                )
        out = []
        for k, n in need.items():
            e = self._entries[k]
            e.pins -= n
            out.append(e)
            self._sync(e, used=True)
        return out

    def hold(self, entries: Sequence[Entry]) -> None:
        for e in entries:
            e.busy += 1
            self._sync(e)

    def unhold(self, entries: Sequence[Entry]) -> None:
        for e in entries:
            e.busy -= 1
            self._sync(e, used=True)

    # -- saves ----------------------------------------------------------------
    def add_pending(self, key: bytes, host_block: int) -> Entry:
        """A save of ``key`` into ``host_block`` has started (entry invisible, held)."""
        e = self._entries.get(key)
        if e is None:
            e = self._entries[key] = Entry(key)
        e.pending, e.host_block = True, host_block
        e.busy += 1
        self._sync(e)
        return e

    def commit(self, e: Entry) -> None:
        e.pending = False
        e.busy -= 1
        self._set(e, Residency.HOST, True)

    def abort(self, e: Entry) -> None:
        e.pending, e.host_block = False, None
        e.busy -= 1
        self._sync(e)

    # -- residency ------------------------------------------------------------
    def add_storage(self, key: bytes) -> Entry:
        """``key`` has a STORAGE copy (found by a scan or written by a demotion)."""
        e = self._entries.get(key)
        if e is None:
            e = self._entries[key] = Entry(key)
        self._set(e, Residency.STORAGE, True)
        return e

    def add_host(self, key: bytes, block: int) -> Entry:
        """``key`` is published in host ``block`` (warm boot)."""
        e = self._entries.get(key)
        if e is None:
            e = self._entries[key] = Entry(key)
        self.set_host(e, block)
        return e

    def set_host(self, e: Entry, block: int) -> None:
        e.host_block = block
        self._set(e, Residency.HOST, True)

    def clear(self, e: Entry, tier: Residency) -> int | None:
        """Drop ``e``'s copy in ``tier``; returns the host block it held (HOST) or None."""
        block = None
        if tier is Residency.HOST:
            block, e.host_block = e.host_block, None
        self._set(e, tier, False)
        return block

    def clear_host(self, e: Entry) -> int:
        """Drop the HOST copy ``e`` has; returns its host block."""
        block = self.clear(e, Residency.HOST)
        assert block is not None, "a HOST copy always has a host block"
        return block

    def mark(self, e: Entry, flag: Residency, present: bool) -> None:
        self._set(e, flag, present)

    def victims(self, tier: Residency, n: int) -> list[Entry] | None:
        """Exactly ``n`` evictable entries of ``tier`` in policy order, or None (nothing changes)."""
        if n <= 0:
            return []
        chosen = self._policy[tier].choose(n)
        return None if chosen is None else [self._entries[k] for k in chosen]

    def coldest(self, tier: Residency, n: int) -> list[Entry]:
        """Up to ``n`` evictable entries of ``tier``, coldest first."""
        return self.victims(tier, min(n, self.evictable(tier))) or []

    # -- internals ------------------------------------------------------------
    def _set(self, e: Entry, tier: Residency, present: bool) -> None:
        had = bool(e.residency & tier)
        e.residency = (e.residency | tier) if present else (e.residency & ~tier)
        if tier in self.counts and had != present:
            self.counts[tier] += 1 if present else -1
        self._sync(e)

    def _sync(self, e: Entry, used: bool = False) -> None:
        for tier, policy in self._policy.items():
            want = e.idle and bool(e.residency & tier)
            if want and e.key not in policy:
                policy.add(e.key)
                if used:
                    policy.touch(e.key)  # back from a pin or hold: it was just used
            elif not want and e.key in policy:
                policy.remove(e.key)
        if e.idle and not e.residency:
            self._entries.pop(e.key, None)
