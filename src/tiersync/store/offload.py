"""Bookkeeping for a byte mover that lives in another process: host slots, pins, LRU, storage.

A serving engine's scheduler decides *what* moves and a worker process moves the bytes
(vLLM runs them in different processes). :class:`OffloadManager` is the scheduler's half:
it maps block keys to slots of a host arena that only the worker has mapped, and answers
``lookup`` / ``prepare_load`` / ``prepare_store`` with plain spec objects that the
scheduler ships to the worker. No bytes move here and nothing is thread-safe.

Contract with the worker (which executes specs strictly in the order they were issued):

- A :class:`StoreSpec` slot may be reused by a later spec as soon as the spec is issued:
  the worker has finished the copy before it executes anything issued later.
- A key stays *held* (never evicted, its slot never reused) from :meth:`prepare_store`
  with ``to_storage`` until :meth:`storage_done` reports the asynchronous disk write.
- The manager commits optimistically; the worker validates every slot against the key it
  last wrote there and reports failures (:meth:`invalidate`), so a failed save or read
  becomes a miss, never wrong bytes.

With ``track_changes`` the manager also keeps a log of :class:`TierChange` (a key gained or
lost its host or disk copy: stored, promoted, evicted, invalidated), drained by
:meth:`take_changes`; the vLLM connector turns it into KV events for routers.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tiersync.errors import UsageError, check_positive_int
from tiersync.store.index import PinIndex
from tiersync.store.keys import KEY_NBYTES, check_keys
from tiersync.store.residency import Residency
from tiersync.tiers.eviction import POLICIES, check_policy

__all__ = ["LoadSpec", "OffloadConfig", "OffloadManager", "StoreSpec", "TierChange"]


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    """``num_slots`` host slots; ``policy`` orders host eviction; ``storage`` enables the
    disk tier (every stored block is also written to disk, and disk hits are loaded);
    ``track_changes`` keeps the log of :class:`TierChange` (off: nothing is recorded)."""

    num_slots: int
    policy: str = "lru"
    storage: bool = False
    track_changes: bool = False

    def __post_init__(self) -> None:
        check_positive_int(self.num_slots, "OffloadConfig.num_slots")
        for name in ("storage", "track_changes"):
            if not isinstance(getattr(self, name), bool):
                raise UsageError("must be a bool", argument=f"OffloadConfig.{name}", value=getattr(self, name))
        check_policy(self.policy, "OffloadConfig.policy")


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Copy ``slots[i]`` (holding ``keys[i]``) to the engine; read it from disk first when
    ``from_storage[i]``."""

    keys: tuple[bytes, ...]
    slots: tuple[int, ...]
    from_storage: tuple[bool, ...]

    def __len__(self) -> int:
        return len(self.keys)


@dataclass(frozen=True, slots=True)
class StoreSpec:
    """Copy the engine's blocks of ``keys[i]`` into ``slots[i]``; then write them to disk
    when ``to_storage``."""

    keys: tuple[bytes, ...]
    slots: tuple[int, ...]
    to_storage: bool

    def __len__(self) -> int:
        return len(self.keys)


@dataclass(frozen=True, slots=True)
class TierChange:
    """``key`` gained (``stored``) or lost its copy in ``tier`` (HOST or STORAGE)."""

    key: bytes
    tier: Residency
    stored: bool


class OffloadManager:
    """Host-slot and storage index of one cache identity (see the module docstring)."""

    def __init__(self, config: OffloadConfig) -> None:
        if not isinstance(config, OffloadConfig):
            raise UsageError("must be an OffloadConfig", argument="config", got=type(config).__name__)
        self.config = config
        self._index = PinIndex(POLICIES[config.policy](), POLICIES[config.policy]())
        self._free = list(range(config.num_slots - 1, -1, -1))
        self._parked: dict[bytes, list[int]] = {}  # slots of invalidated keys still pinned or held
        self._changes: list[TierChange] = []
        self.evictions = 0

    def __repr__(self) -> str:
        return (
            f"OffloadManager(slots={self.config.num_slots}, free={len(self._free)}, "
            f"host={self._index.counts[Residency.HOST]}, storage={self._index.counts[Residency.STORAGE]})"
        )

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_parked_slots(self) -> int:
        """Slots of invalidated keys that a load or a disk write still uses: free once it ends."""
        return sum(len(v) for v in self._parked.values())

    def residency(self, key: bytes) -> Residency:
        e = self._index.get(key)
        return Residency.NONE if e is None else e.residency

    def pins(self, key: bytes) -> int:
        e = self._index.get(key)
        return 0 if e is None else e.pins

    # -- lookups and loads ------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are loadable now (host or disk). Pins nothing."""
        check_keys(keys, nbytes=KEY_NBYTES)
        n = 0
        for k in keys:
            if self._index.visible(k) is None:
                break
            n += 1
        return n

    def prepare_load(self, keys: Sequence[bytes]) -> LoadSpec:
        """Pin the longest loadable prefix of ``keys`` and give each a slot.

        Disk-only keys get a slot (free first, else the coldest idle host entry is
        evicted) and are promoted to host as of now. The spec may be shorter than
        ``keys`` (a miss, or no slot for a disk hit); it is empty when nothing is
        loadable. Every key in the spec stays pinned until :meth:`release`.
        """
        n = self.lookup(keys)
        entries = [e for k in keys[:n] if (e := self._index.get(k)) is not None]  # all n: lookup found them
        self._index.pin(entries)  # pinned first: evicting for disk hits never takes them
        slots, disk = [], []
        for i, e in enumerate(entries):
            from_disk = not (e.residency & Residency.HOST)
            slot = self._take_slot() if from_disk else e.host_block
            if slot is None:
                self._index.unpin([x.key for x in entries[i:]])
                entries = entries[:i]
                break
            if from_disk:
                self._index.set_host(e, slot)
                self._note(e.key, Residency.HOST, True)
            slots.append(slot)
            disk.append(from_disk)
        return LoadSpec(tuple(e.key for e in entries), tuple(slots), tuple(disk))

    def release(self, keys: Sequence[bytes]) -> None:
        """Drop one pin per key (all-or-nothing; :class:`UsageError` for an unpinned key)."""
        check_keys(keys, nbytes=KEY_NBYTES)
        self._index.unpin(keys)
        self._unpark(keys)

    # -- stores -------------------------------------------------------------------
    def prepare_store(self, keys: Sequence[bytes]) -> StoreSpec:
        """Slots for the ``keys`` not already cached, in order; the keys are cached as of now.

        Takes free slots first, then evicts the coldest idle host entries (entries with a
        disk copy stay loadable from disk). Stops at the first key it finds no slot for,
        so the spec may be shorter than asked; nothing pinned is ever evicted.
        """
        check_keys(keys, nbytes=KEY_NBYTES)
        wanted, seen = [], set()
        for k in keys:
            e = self._index.get(k)
            if k not in seen and (e is None or not (e.residency & Residency.HOST)):
                wanted.append(k)
                seen.add(k)
        out_keys, slots = [], []
        for k in wanted:
            slot = self._take_slot()
            if slot is None:
                break
            e = self._index.add_host(k, slot)
            self._note(k, Residency.HOST, True)
            if self.config.storage:
                self._index.hold([e])
            out_keys.append(k)
            slots.append(slot)
        return StoreSpec(tuple(out_keys), tuple(slots), self.config.storage and bool(out_keys))

    def storage_done(self, ok: Iterable[bytes], failed: Iterable[bytes] = ()) -> None:
        """The worker's disk writes of ``ok`` are durable, those of ``failed`` are not;
        both end the hold :meth:`prepare_store` took."""
        for k, present in [(k, True) for k in ok] + [(k, False) for k in failed]:
            e = self._index.get(k)
            if e is None or e.busy == 0:
                continue  # already invalidated
            if present and not e.residency & Residency.STORAGE:
                self._index.mark(e, Residency.STORAGE, True)
                self._note(k, Residency.STORAGE, True)
            self._index.unhold([e])
            self._unpark([k])

    def add_storage(self, keys: Iterable[bytes]) -> int:
        """Record disk copies found by a directory scan; returns how many were new."""
        new = 0
        for k in keys:
            e = self._index.get(k)
            if e is None or not (e.residency & Residency.STORAGE):
                new += 1
                self._note(k, Residency.STORAGE, True)
            self._index.add_storage(k)
        return new

    def invalidate(self, keys: Iterable[bytes], *, storage: bool = False) -> None:
        """The worker found ``keys`` missing or corrupt in their slot (and on disk when
        ``storage``): they stop being hits. Pins and holds are kept (the entry becomes
        a tombstone until they are dropped), and so is the slot of a pinned or held key: a
        load or disk write still under way uses it, and it is free once that ended."""
        for k in keys:
            e = self._index.get(k)
            if e is None:
                continue
            if e.residency & Residency.HOST:
                slot = self._index.clear(e, Residency.HOST)
                if slot is not None and (e.pins or e.busy):
                    self._parked.setdefault(k, []).append(slot)
                else:
                    self._free_slot(slot)
                self._note(k, Residency.HOST, False)
            if storage and e.residency & Residency.STORAGE:
                self._index.clear(e, Residency.STORAGE)
                self._note(k, Residency.STORAGE, False)

    def take_changes(self) -> list[TierChange]:
        """The tier changes since the last call, in order (empty unless ``track_changes``)."""
        out, self._changes = self._changes, []
        return out

    def _note(self, key: bytes, tier: Residency, stored: bool) -> None:
        if self.config.track_changes:
            self._changes.append(TierChange(key, tier, stored))

    # -- slots --------------------------------------------------------------------
    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        victims = self._index.victims(Residency.HOST, 1)
        if not victims:
            return None
        self.evictions += 1
        self._note(victims[0].key, Residency.HOST, False)
        return self._index.clear(victims[0], Residency.HOST)

    def _free_slot(self, slot: int | None) -> None:
        if slot is not None:
            self._free.append(slot)

    def _unpark(self, keys: Iterable[bytes]) -> None:
        """Free the parked slots of ``keys`` no longer pinned nor held."""
        for k in keys:
            e = self._index.get(k)
            if k in self._parked and (e is None or not (e.pins or e.busy)):
                self._free.extend(self._parked.pop(k))
