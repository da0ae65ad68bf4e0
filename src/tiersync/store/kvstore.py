"""KV cache store: a prefix-keyed index over host DRAM and storage, split from the byte movers.

Bookkeeping (:mod:`tiersync.store.index`) decides; the :class:`TransferEngine` (device <->
host) and :class:`StorageTier` (host <-> storage) move bytes. The store owns every host
block it uses: a block holding an entry stays LOCKED once in the arena's allocator, so
the allocator never evicts it on its own; the store evicts by its policy and frees.

Pin algebra (the reference system's), exactly:

- ``lookup(keys)`` returns the longest visible prefix and adds ONE pin to each key
  returned. Keys after the first miss are not pinned.
- ``load(keys, ...)`` needs every key pinned. When it succeeds it consumes ONE pin per
  key; when it fails (its future raises, or it raises at once) every pin is kept.
- ``release(keys)`` drops ONE pin per key (a key named twice drops two); unpinned keys
  raise :class:`UsageError` and nothing changes.
- ``save(...)`` neither needs nor leaves pins; the entries it creates are invisible
  until their d2h copy is done and published.
- Pinned entries (and those with a store operation in flight) are never evicted from
  any tier and never demoted; eviction takes the coldest idle entries of a tier.

Thread-safe: one lock guards the index; it is never held while waiting for I/O.

Structure: the store holds its shared state in one :class:`~tiersync.store.holdings.Holdings`
(index, arena, storage, engine, metrics, lock) and hands it to three collaborators: a
:class:`~tiersync.store.loading.Loader` (``load``), a :class:`~tiersync.store.demotion.Demoter`
(watermark sweeps and write-downs before eviction) and the
:class:`~tiersync.store.remote.RemoteHooks` a store-node sweeper uses. Lookups, pins and saves
are here.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Sequence

from tiersync.errors import ClosedError, UsageError
from tiersync.layout.pool import KVLayout
from tiersync.store.config import LookupResult, SaveResult, StoreConfig, StoreStats
from tiersync.store.demotion import Demoter
from tiersync.store.futures import StoreFuture
from tiersync.store.holdings import Holdings
from tiersync.store.index import Entry, PinIndex
from tiersync.store.keys import check_keys
from tiersync.store.loading import Loader
from tiersync.store.remote import RemoteHooks
from tiersync.store.residency import Residency
from tiersync.telemetry.store_metrics import StoreMetrics
from tiersync.tiers.eviction import POLICIES
from tiersync.tiers.host import HostArena
from tiersync.tiers.storage import StorageTier
from tiersync.transfer.engine import TransferEngine
from tiersync.transfer.future import TransferFuture

log = logging.getLogger("tiersync.store")
HOST, STORAGE = Residency.HOST, Residency.STORAGE


class KVCacheStore:
    """Prefix-keyed KV blocks in host DRAM (and optionally storage) for one ``layout``.

    ``arena`` may be given (e.g. warm-booted from /dev/shm by the caller); otherwise one
    of ``config.host_blocks`` blocks is made. Published blocks of a warm-booted arena
    (``arena.recovered``) and the blocks found in ``storage`` rebuild the index.
    """

    def __init__(
        self,
        layout: KVLayout,
        config: StoreConfig,
        *,
        arena: HostArena | None = None,
        storage: StorageTier | None = None,
        metrics: StoreMetrics | None = None,
    ) -> None:
        if not isinstance(config, StoreConfig):
            raise UsageError("must be a StoreConfig", argument="config", got=type(config).__name__)
        if storage is not None and not isinstance(storage, StorageTier):
            raise UsageError("must be a StorageTier or None", argument="storage", got=type(storage).__name__)
        self.config, self.layout, self.storage = config, layout, storage
        self.arena = (
            arena
            if arena is not None
            else HostArena.for_layout(layout, config.host_blocks, shm=config.shm, policy=config.policy)
        )
        self._own_arena = arena is None
        self.metrics = metrics if metrics is not None else StoreMetrics()  # the default registry
        self._own_metrics = metrics is None
        policy = POLICIES[config.policy]
        self._h = Holdings(
            config,
            PinIndex(policy(), policy()),
            self.arena,
            storage,
            TransferEngine(layout, self.arena, config.transfer),
            self.metrics,
        )
        self._index, self._lock = self._h.index, self._h.lock
        self._demoter = Demoter(self._h)
        self._loader = Loader(self._h, self._demoter)
        self._remote = RemoteHooks(self._h)
        self._adopt_recovered()
        if storage is not None:
            for k in storage.keys():  # noqa: SIM118 - a StorageTier method (a list), not a dict
                self._index.add_storage(k)
        self._h.gauge()

    @property
    def engine(self) -> TransferEngine:
        """The transfer engine between the layout's pools and the host arena."""
        return self._h.engine

    def _adopt_recovered(self) -> None:
        recovered = sorted(self.arena.recovered, key=lambda r: r.seq)
        if not recovered:
            return
        self.arena.allocator.lock([r.block for r in recovered])  # CACHED -> owned (LOCKED once)
        for r in recovered:
            e = self._index.get(r.key)
            if e is not None and e.residency & HOST:  # same key published twice: keep the newest
                self.arena.free([self._index.clear_host(e)])
            self._index.add_host(r.key, r.block)
        log.info("store index rebuilt from %d warm-booted host blocks", len(recovered))

    # -- queries -------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        """Longest prefix of ``keys`` that is loadable; pins each returned key once.

        A key not in the index is looked for in storage segments written since the
        last scan (by this or another process) before it counts as a miss.
        """
        keys = check_keys(keys)
        with self._lock:
            self._h.check_open()
            scan = self.storage is not None and len(self._prefix(keys)) < len(keys)
        # outside the lock: lookups go on meanwhile
        found = self.storage.refresh() if scan and self.storage is not None else []
        with self._lock:
            self._h.check_open()
            if scan and self.storage is not None:
                self._absorb(found)
                self._absorb([k for k in keys if self._index.visible(k) is None and self.storage.contains(k)])
            hits = self._prefix(keys)
            self._index.pin(hits)
            res = tuple(e.residency for e in hits)
        for r in res:
            self.metrics.hits.labels("host" if r & HOST else "storage").inc()
        self.metrics.misses.inc(len(keys) - len(hits))
        return LookupResult(tuple(keys[: len(hits)]), res, len(keys))

    def _prefix(self, keys: list[bytes]) -> list[Entry]:
        hits = []
        for k in keys:
            e = self._index.visible(k)
            if e is None:
                break
            hits.append(e)
        return hits

    def _absorb(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            self._index.add_storage(k)

    def residency(self, keys: Sequence[bytes]) -> list[Residency]:
        """Current copies of each key (``Residency.NONE`` when unknown). Pins nothing."""
        with self._lock:
            out = []
            for k in check_keys(keys):
                e = self._index.get(k)
                out.append(Residency.NONE if e is None or e.pending else e.residency)
            return out

    def pins(self, key: bytes) -> int:
        with self._lock:
            e = self._index.get(key)
            return 0 if e is None else e.pins

    def stats(self) -> StoreStats:
        with self._lock:
            ix = self._index
            return StoreStats(
                len(ix),
                ix.counts[HOST],
                ix.counts[STORAGE],
                self.arena.allocator.num_free,
                ix.evictable(HOST),
                ix.evictable(STORAGE),
                sum(1 for e in ix.entries() if e.pins),
            )

    def mark(self, keys: Sequence[bytes], flag: Residency, present: bool = True) -> None:
        """Record DEVICE / REMOTE copies of known keys (bookkeeping only; not loadable from here)."""
        if flag not in (Residency.DEVICE, Residency.REMOTE):
            raise UsageError("only DEVICE or REMOTE can be marked", argument="flag", value=flag)
        with self._lock:
            for k in check_keys(keys):
                e = self._index.get(k)
                if e is not None:
                    self._index.mark(e, flag, present)

    # -- collaborators ---------------------------------------------------------
    def load(self, keys: Sequence[bytes], device_blocks: Sequence[int]) -> StoreFuture[None]:
        """See :meth:`tiersync.store.loading.Loader.load`."""
        return self._loader.load(keys, device_blocks)

    def wait_demotions(self, timeout: float | None = None) -> bool:
        """Block until no demotion is in flight and none is due. False on timeout."""
        return self._demoter.wait(timeout)

    def take_evictable(self, n: int) -> list[tuple[bytes, memoryview]]:
        """See :meth:`tiersync.store.remote.RemoteHooks.take_evictable`."""
        return self._remote.take_evictable(n)

    def give_back(self, keys: Sequence[bytes], *, remote: bool = False, drop: bool = False) -> int:
        """See :meth:`tiersync.store.remote.RemoteHooks.give_back`."""
        return self._remote.give_back(keys, remote=remote, drop=drop)

    def insert_host(
        self, keys: Sequence[bytes], fill: Callable[[list[bytes], list[memoryview]], None]
    ) -> tuple[bytes, ...]:
        """See :meth:`tiersync.store.remote.RemoteHooks.insert_host`."""
        return self._remote.insert_host(keys, fill)

    # -- pins ----------------------------------------------------------------
    def release(self, keys: Sequence[bytes]) -> None:
        """Drop one pin per key (all-or-nothing; UsageError naming ``keys`` if one is not pinned)."""
        keys = check_keys(keys)
        with self._lock:
            self._index.unpin(keys)

    # -- saves: device -> host -----------------------------------------------
    def save(self, device_blocks: Sequence[int], keys: Sequence[bytes]) -> StoreFuture[SaveResult]:
        """Copy ``device_blocks[i]`` to host as ``keys[i]``; all-or-nothing.

        Keys already present (any tier) or being saved are skipped and reported.
        Host blocks come from free space, then by evicting idle host entries (never
        pinned ones); when that is not enough it raises :class:`CapacityError` and
        nothing changes. The future's result is a :class:`SaveResult`; if the copy
        fails, the new entries are dropped and the future raises.
        """
        keys, dev = check_keys(keys), [int(d) for d in device_blocks]
        if len(dev) != len(keys):
            raise UsageError("needs one key per device block", argument="keys", keys=len(keys), blocks=len(dev))
        fut: StoreFuture[SaveResult] = StoreFuture()
        self._demoter.room_for_save(keys)  # evict only what is safe on storage (demotion.py)
        with self._lock:
            self._h.check_open()
            new, skipped, seen = [], [], set()
            for d, k in zip(dev, keys):
                e = self._index.get(k)
                if k in seen or (e is not None and (e.visible or e.pending)):
                    skipped.append(k)
                else:
                    seen.add(k)
                    new.append((d, k))
            if not new:
                fut._settle(SaveResult((), tuple(skipped)))
                return fut
            blocks = self._h.allocate_host(len(new))
            entries = [self._index.add_pending(k, b) for (_, k), b in zip(new, blocks)]
            try:
                tf = self._h.engine.d2h([(d, b, 1) for (d, _), b in zip(new, blocks)])
            except BaseException:
                self._h.drop_pending(entries, blocks)
                raise
        tf.add_done_callback(lambda t: self._saved(t, entries, blocks, tuple(skipped), fut))
        return fut

    def _saved(
        self,
        tf: TransferFuture,
        entries: list[Entry],
        blocks: list[int],
        skipped: tuple[bytes, ...],
        fut: StoreFuture[SaveResult],
    ) -> None:
        exc = tf.exception()
        with self._lock:
            if exc is None and not self._h.closed:
                try:
                    self.arena.publish(blocks, [e.key for e in entries])
                except Exception as err:  # noqa: BLE001 - delivered through the future
                    exc = err
            if exc is not None or self._h.closed:
                self._h.drop_pending(entries, blocks)
            else:
                for e in entries:
                    self._index.commit(e)
            self._h.gauge()
        if exc is not None:
            fut._fail(exc)
            return
        if self._h.closed:
            fut._fail(ClosedError("store closed during save"))
            return
        self.metrics.bytes.labels("host", "in").inc(len(blocks) * self.arena.block_nbytes)
        fut._settle(SaveResult(tuple(e.key for e in entries), skipped))
        self._demoter.maybe_demote()

    # -- lifecycle -----------------------------------------------------------
    def close(self) -> None:
        """Finish copies in flight, then stop. Idempotent. Closes the arena if the store made it."""
        if self._h.closed:
            return
        self._h.engine.close(wait=True)
        if self.storage is not None:
            self.storage.close()
        with self._lock:
            self._h.closed = True
        # The engine keeps a reference to the arena's memory (its threads form a cycle),
        # and an shm arena refuses to unmap while one is alive: drop and collect it first.
        self._h.engine = None  # type: ignore[assignment]
        if self.arena.persistent:
            gc.collect()
        if self._own_arena:
            self.arena.close()
        if self._own_metrics:  # a closed store's series leave the process's registry
            self.metrics.release()

    def __enter__(self) -> KVCacheStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
