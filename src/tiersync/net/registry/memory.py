"""In-memory registry backend (embedded default, usable in-process)."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence

from tiersync.net.registry.base import Registry, RegistryConfig, StoreInfo, check_keys, rank_targets


class MemoryRegistry(Registry):
    """Dict-backed :class:`Registry`. ``clock``: seconds, monotonic (injectable for TTL tests)."""

    def __init__(self, config: RegistryConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or RegistryConfig()
        self._clock = clock
        self._stores: dict[str, tuple[StoreInfo, float]] = {}  # id -> (info, expires_at)
        self._owners: dict[bytes, dict[str, tuple[float, int]]] = {}  # key -> {store id: (expires_at, incarnation)}
        self._lock = threading.Lock()

    def register_store(self, info: StoreInfo) -> None:
        with self._lock:
            self._stores[info.store_id] = (info, self._clock() + self.config.store_ttl_s)

    def heartbeat(self, store_id: str, free_blocks: int) -> bool:
        now = self._clock()
        with self._lock:
            entry = self._stores.get(store_id)
            if entry is None or entry[1] <= now:
                return False
            info = dataclasses.replace(entry[0], free_blocks=free_blocks)
            self._stores[store_id] = (info, now + self.config.store_ttl_s)
            return True

    def remove_store(self, store_id: str) -> None:
        with self._lock:
            self._stores.pop(store_id, None)

    def get_store(self, store_id: str) -> StoreInfo | None:
        with self._lock:
            entry = self._stores.get(store_id)
        return entry[0] if entry is not None and entry[1] > self._clock() else None

    def publish(self, store_id: str, keys: Sequence[bytes]) -> None:
        """Record ``keys`` as held by a registered, live store; keys of any other are ignored (an
        unauthenticated caller could otherwise grow the registry with made-up store ids)."""
        check_keys(keys)
        now = self._clock()
        expires = now + self.config.block_ttl_s
        with self._lock:
            entry = self._stores.get(store_id)
            if entry is None or entry[1] <= now:
                return
            for key in keys:
                self._owners.setdefault(key, {})[store_id] = (expires, entry[0].incarnation)

    def unpublish(self, store_id: str, keys: Sequence[bytes]) -> None:
        check_keys(keys)
        with self._lock:
            for key in keys:
                owners = self._owners.get(key)
                if owners is not None:
                    owners.pop(store_id, None)
                    if not owners:
                        del self._owners[key]

    def lookup(self, keys: Sequence[bytes]) -> list[tuple[str, ...]]:
        now = self._clock()
        get = self._owners.get
        with self._lock:
            live = {sid: info.incarnation for sid, (info, exp) in self._stores.items() if exp > now}
            out = []
            for key in keys:
                owners = get(key)
                if owners:
                    out.append(tuple(s for s, (exp, inc) in owners.items() if exp > now and live.get(s, -1) == inc))
                else:
                    out.append(())
        return out

    def placement_targets(self, pool_group: str, count: int, exclude: Sequence[str] = ()) -> list[StoreInfo]:
        now = self._clock()
        with self._lock:
            live = [info for info, exp in self._stores.values() if exp > now]
        return rank_targets(live, pool_group, count, exclude)

    def sweep(self) -> int:
        """Drop expired ownership entries and stores; returns how many entries went."""
        now = self._clock()
        dropped = 0
        with self._lock:
            for key in list(self._owners):
                owners = self._owners[key]
                for sid in [s for s, (exp, _) in owners.items() if exp <= now]:
                    del owners[sid]
                    dropped += 1
                if not owners:
                    del self._owners[key]
            for sid in [s for s, (_, exp) in self._stores.items() if exp <= now]:
                del self._stores[sid]
        return dropped
