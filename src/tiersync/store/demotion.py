"""Host -> storage demotion by watermarks (the :class:`Demoter` of a :class:`KVCacheStore`).

When free host blocks fall under ``low_watermark`` (after a save or a promotion), the
coldest idle host entries are written to storage in batches of ``demote_batch`` (one
segment each) until ``high_watermark`` are free: entries already in storage just drop
their host copy; the others are held (not evictable, not demotable twice) while their
segment is written, then gain STORAGE and, if still idle, drop their host copy. An entry
pinned meanwhile keeps both. Storage over ``capacity_blocks`` first evicts its coldest
idle entries. A failed write (disk full, ...) is logged and retried no sooner than 1 s
later; the host copies are untouched, so nothing is lost.

Eviction never loses a block the sweep did not get to: with a storage tier, before a
save or a promotion takes host blocks by evicting idle entries, those entries that
have no storage copy yet are written down first (:meth:`Demoter.room_for_save` / ``room_for_load``, the
caller's thread waits for that write, the lock released, at most ``demote_wait_s``: a
write still running then keeps its entries on host until it ends), so only blocks
already safe on storage are evicted. Only when that write fails (disk full, ...) or storage has no
room left are they dropped anyway (the reference's "no target: evict locally"),
counted as ``tiersync_store_evictions_total{tier="host_unsaved"}`` and logged.
Without a storage tier, eviction simply drops the coldest idle host entries.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from tiersync.store.index import Entry
from tiersync.store.residency import Residency

if TYPE_CHECKING:
    from tiersync.store.holdings import Holdings

log = logging.getLogger("tiersync.store")
HOST, STORAGE = Residency.HOST, Residency.STORAGE


class Demoter:
    """Writes cold host entries of ``holdings`` down to its storage tier (see the module doc);
    does nothing without one."""

    def __init__(self, holdings: Holdings) -> None:
        self._h = holdings
        self._demoting = False
        self._idle = threading.Condition(holdings.lock)
        self._backoff_until = 0.0
        self._sweeping = False

    def wait(self, timeout: float | None = None) -> bool:
        """Block until no demotion is in flight and none is due. False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._h.lock:
                left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                if not self._idle.wait_for(lambda: not self._demoting, left):
                    return False
            self.maybe_demote()
            with self._h.lock:
                if not self._demoting:
                    return True

    def maybe_demote(self) -> None:
        """When free host blocks < low watermark, write the coldest idle entries down until high."""
        if self._h.storage is None:
            return
        n = self._h.arena.num_blocks
        with self._h.lock:
            free = self._h.arena.allocator.num_free
            if self._h.closed or self._demoting or time.monotonic() < self._backoff_until:
                return
            # hysteresis: a sweep starts under the low watermark and goes on until the high one
            mark = self._h.config.high_watermark if self._sweeping else self._h.config.low_watermark
            if free >= math.ceil(mark * n):
                self._sweeping = False
                return
            self._sweeping = True
            want = max(math.ceil(self._h.config.high_watermark * n) - free, 1)
            victims = self._h.index.coldest(HOST, want)
            stored = [e for e in victims if e.residency & STORAGE]
            if stored:
                self._h.arena.free([self._h.index.clear_host(e) for e in stored])
            batch = self._make_room([e for e in victims if not e.residency & STORAGE][: self._h.config.demote_batch])
            if not batch:
                return
            self._h.index.hold(batch)
            self._demoting = True
            views = [self._h.arena.block(e.block) for e in batch]
        try:
            wf = self._h.storage.write([e.key for e in batch], views)
        except BaseException as exc:  # noqa: BLE001
            self._demoted(None, batch, exc)
            return
        wf.add_done_callback(lambda f: self._demoted(f, batch, f.exception()))

    def _ensure_host_room(self, need: Callable[[], int]) -> None:
        """Before an allocation of ``need()`` host blocks (called under the lock): write the
        idle entries it would evict that have no storage copy to storage, and free them."""
        if self._h.storage is None or self._h.storage.in_io_thread():  # e.g. a load's callback: must not wait
            return
        for _ in range(3):  # others may take the room meanwhile; then the allocation counts it
            with self._h.lock:
                if self._h.closed or time.monotonic() < self._backoff_until:
                    return
                short = need() - self._h.arena.allocator.num_free
                victims = self._h.index.victims(HOST, short) if short > 0 else None
                unsafe = [e for e in victims or () if not e.residency & STORAGE]
                batch = self._make_room(unsafe)
                if not batch:
                    return
                self._h.index.hold(batch)
                views = [self._h.arena.block(e.block) for e in batch]
            try:
                wf = self._h.storage.write([e.key for e in batch], views)
            except BaseException as e:  # noqa: BLE001 - the allocation then evicts and counts
                self._written_down(batch, e)
                return
            if not self._wait_written(wf, batch):
                return

    def _wait_written(self, wf: Future[None], batch: list[Entry]) -> bool:
        """Wait for the write-down ``wf`` of ``batch``, at most ``config.demote_wait_s``; True
        when it succeeded. A write still running then is left to finish: its entries stay held
        (their host blocks are the write's source, so they must not be reused) and settle
        when it ends, and the caller goes on without that room."""
        try:
            wf.result(timeout=self._h.config.demote_wait_s)
        except TimeoutError:
            if not wf.done():
                log.warning(
                    "storage write of %d evicted host entries still running after %.0f s; not "
                    "waiting for it (they stay on host until it ends)",
                    len(batch),
                    self._h.config.demote_wait_s,
                )
            wf.add_done_callback(lambda f: self._written_down(batch, f.exception()))
            return False
        except BaseException as e:  # noqa: BLE001 - the allocation then evicts and counts
            self._written_down(batch, e)
            return False
        self._written_down(batch, None)
        return True

    def _written_down(self, batch: list[Entry], exc: BaseException | None) -> None:
        with self._h.lock:
            self._settle_write(batch, exc, "writing evicted host entries to storage failed; they will be dropped: %s")

    def _settle_write(self, batch: list[Entry], exc: BaseException | None, failure: str) -> None:
        """Under the lock: a write of ``batch`` to storage ended; on success they are on
        storage and leave host when idle, on failure demotion backs off for 1 s."""
        self._h.index.unhold(batch)
        if exc is not None:
            log.warning(failure, exc)
            self._backoff_until = time.monotonic() + 1.0
        else:
            for e in batch:
                self._h.index.mark(e, STORAGE, True)
                if e.idle and e.residency & HOST:
                    self._h.arena.free([self._h.index.clear_host(e)])
        self._h.gauge()
        if exc is None:
            self._h.metrics.demotions.inc(len(batch))
            self._h.metrics.bytes.labels("storage", "in").inc(len(batch) * self._h.arena.block_nbytes)

    def room_for_save(self, keys: list[bytes]) -> None:
        """Before a save of ``keys`` takes host blocks: write down what it would evict unsaved."""

        def need() -> int:
            return sum(1 for k in set(keys) if (e := self._h.index.get(k)) is None or not (e.visible or e.pending))

        self._ensure_host_room(need)

    def room_for_load(self, keys: list[bytes]) -> None:
        """Before a load of ``keys`` promotes storage entries: write down what it would evict unsaved."""

        def need() -> int:  # 0 when the load will be refused (a key not pinned): change nothing
            entries = [self._h.index.get(k) for k in set(keys)]
            if any(e is None or e.pins == 0 or not e.visible for e in entries):
                return 0
            return sum(1 for e in entries if e is not None and not e.residency & HOST)

        self._ensure_host_room(need)

    def _make_room(self, batch: list[Entry]) -> list[Entry]:
        assert self._h.storage is not None  # called only with a storage tier
        cap = self._h.storage.config.capacity_blocks
        if cap is None or not batch:
            return batch
        over = self._h.index.counts[STORAGE] + len(batch) - cap
        victims = self._h.index.coldest(STORAGE, over) if over > 0 else []
        if victims:
            self._h.storage.delete([e.key for e in victims])
            for e in victims:
                self._h.index.clear(e, STORAGE)
            self._h.metrics.evictions.labels("storage").inc(len(victims))
        return batch[: max(len(batch) - (over - len(victims)), 0)] if over > 0 else batch

    def _demoted(self, wf: Future[None] | None, batch: list[Entry], exc: BaseException | None) -> None:
        with self._h.lock:
            self._demoting = False
            self._idle.notify_all()
            self._settle_write(batch, exc, "demotion to storage failed, retrying in 1 s: %s")
        if exc is None:
            self.maybe_demote()
