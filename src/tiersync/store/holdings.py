"""What every part of a KV cache store shares, under one lock.

:class:`Holdings` is handed to each collaborator of
:class:`~tiersync.store.kvstore.KVCacheStore` (the :class:`~tiersync.store.loading.Loader`,
the :class:`~tiersync.store.demotion.Demoter`, the
:class:`~tiersync.store.remote.RemoteHooks`): the pin index that decides, the host arena and
storage tier that hold bytes, the transfer engine that moves them to and from the device, the
metrics, and the few operations more than one of them needs (host room, dropping entries
never published, the entry gauges). Every field is read and changed under :attr:`lock`, which
is never held while waiting for I/O.
"""

from __future__ import annotations

import logging
import threading

from tiersync.errors import CapacityError, ClosedError
from tiersync.store.config import StoreConfig
from tiersync.store.index import Entry, PinIndex
from tiersync.store.residency import Residency
from tiersync.telemetry.store_metrics import StoreMetrics
from tiersync.tiers.host import HostArena
from tiersync.tiers.storage import StorageTier
from tiersync.transfer.engine import TransferEngine

__all__ = ["Holdings"]

log = logging.getLogger("tiersync.store")
HOST, STORAGE = Residency.HOST, Residency.STORAGE


class Holdings:
    """The shared state of one store (see the module doc)."""

    def __init__(
        self,
        config: StoreConfig,
        index: PinIndex,
        arena: HostArena,
        storage: StorageTier | None,
        engine: TransferEngine,
        metrics: StoreMetrics,
    ) -> None:
        self.config, self.index, self.arena, self.storage = config, index, arena, storage
        self.engine, self.metrics = engine, metrics
        self.lock = threading.RLock()
        self.closed = False

    def check_open(self) -> None:
        if self.closed:
            raise ClosedError("store is closed")

    def gauge(self) -> None:
        """Publish the entry counts of each tier (under the lock)."""
        self.metrics.entries.labels("host").set(self.index.counts[HOST])
        self.metrics.entries.labels("storage").set(self.index.counts[STORAGE])

    def allocate_host(self, n: int) -> list[int]:
        """``n`` owned host blocks (under the lock): free first, then evicting idle host entries.
        CapacityError when that is not enough (nothing changes then)."""
        need = n - self.arena.allocator.num_free
        victims = self.index.victims(HOST, need)
        if victims is None:
            raise CapacityError(
                "host tier full: not enough free blocks or unpinned entries",
                requested=n,
                free=self.arena.allocator.num_free + self.index.evictable(HOST),
                used=self.arena.num_blocks - self.arena.allocator.num_free,
            )
        if victims:
            self._count_unsaved(victims)
            self.arena.free([self.index.clear_host(e) for e in victims])
            self.metrics.evictions.labels("host").inc(len(victims))
        return self.arena.allocate(n)

    def drop_pending(self, entries: list[Entry], blocks: list[int]) -> None:
        """Entries created for a copy that did not land: gone, and their host blocks free."""
        for e in entries:
            self.index.abort(e)
        self.arena.free(blocks)

    def _count_unsaved(self, victims: list[Entry]) -> None:
        """About to evict ``victims`` from host: count those with no storage copy."""
        if self.storage is None:
            return
        lost = sum(1 for e in victims if not e.residency & STORAGE)
        if lost:
            self.metrics.evictions.labels("host_unsaved").inc(lost)
            log.warning("evicting %d host entries that have no storage copy", lost)
