"""Host -> storage demotion by watermarks (a mixin of :class:`KVCacheStore`).

When free host blocks fall under ``low_watermark`` (after a save or a promotion), the
coldest idle host entries are written to storage in batches of ``demote_batch`` (one
segment each) until ``high_watermark`` are free: entries already in storage just drop
their host copy; the others are held (not evictable, not demotable twice) while their
segment is written, then gain STORAGE and, if still idle, drop their host copy. An entry
pinned meanwhile keeps both. Storage over ``capacity_blocks`` first evicts its coldest
idle entries. A failed write (disk full, ...) is logged and retried no sooner than 1 s
later; the host copies are untouched, so nothing is lost.
"""
from __future__ import annotations

import logging
import math
import time

from tiersync.store.index import Entry
from tiersync.store.residency import Residency

log = logging.getLogger("tiersync.store")
HOST, STORAGE = Residency.HOST, Residency.STORAGE


class DemotionMixin:
    """Needs ``storage``, ``arena``, ``config``, ``metrics``, ``_lock``, ``_index``,
    ``_closed``, ``_demoting``, ``_demote_idle`` (a Condition on ``_lock``), ``_demote_backoff_until`` and ``_gauge``."""

    def wait_demotions(self, timeout: float | None = None) -> bool:
        """Block until no demotion is in flight and none is due. False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                if not self._demote_idle.wait_for(lambda: not self._demoting, left):
                    return False
            self._maybe_demote()
            with self._lock:
                if not self._demoting:
                    return True

    def _maybe_demote(self) -> None:
        """When free host blocks < low watermark, write the coldest idle entries down until high."""
        if self.storage is None:
            return
        n = self.arena.num_blocks
        with self._lock:
            free = self.arena.allocator.num_free
            if self._closed or self._demoting or time.monotonic() < self._demote_backoff_until:
                return
            # hysteresis: a sweep starts under the low watermark and goes on until the high one
            sweeping = getattr(self, "_sweeping", False)
            mark = self.config.high_watermark if sweeping else self.config.low_watermark
            if free >= math.ceil(mark * n):
                self._sweeping = False
                return
            self._sweeping = True
            want = max(math.ceil(self.config.high_watermark * n) - free, 1)
            victims = self._index.coldest(HOST, want)
            stored = [e for e in victims if e.residency & STORAGE]
            if stored:
                self.arena.free([self._index.clear(e, HOST) for e in stored])
            batch = self._make_room([e for e in victims if not e.residency & STORAGE][: self.config.demote_batch])
            if not batch:
                return
            self._index.hold(batch)
            self._demoting = True
            views = [self.arena.block(e.host_block) for e in batch]
        try:
            wf = self.storage.write([e.key for e in batch], views)
        except BaseException as exc:  # noqa: BLE001
            self._demoted(None, batch, exc)
            return
        wf.add_done_callback(lambda f: self._demoted(f, batch, f.exception()))

    def _make_room(self, batch: list[Entry]) -> list[Entry]:
        cap = self.storage.config.capacity_blocks
        if cap is None or not batch:
            return batch
        over = self._index.counts[STORAGE] + len(batch) - cap
        victims = self._index.coldest(STORAGE, over) if over > 0 else []
        if victims:
            self.storage.delete([e.key for e in victims])
            for e in victims:
                self._index.clear(e, STORAGE)
            self.metrics.evictions.labels("storage").inc(len(victims))
        return batch[: max(len(batch) - (over - len(victims)), 0)] if over > 0 else batch

    def _demoted(self, wf, batch: list[Entry], exc: BaseException | None) -> None:
        with self._lock:
            self._demoting = False
            self._demote_idle.notify_all()
            self._index.unhold(batch)
            if exc is not None:
                log.warning("demotion to storage failed, retrying in 1 s: %s", exc)
                self._demote_backoff_until = time.monotonic() + 1.0
            else:
                for e in batch:
                    self._index.mark(e, STORAGE, True)
                    if e.idle and e.residency & HOST:
                        self.arena.free([self._index.clear(e, HOST)])
            self._gauge()
        if exc is None:
            self.metrics.demotions.inc(len(batch))
            self.metrics.bytes.labels("storage", "in").inc(len(batch) * self.arena.block_nbytes)
            self._maybe_demote()

