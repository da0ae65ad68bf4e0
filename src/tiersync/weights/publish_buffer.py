"""A trainer shard's version buffer: where each version is written and GETs read it.

:class:`PublishBuffer` holds the shard's tensors of the version being published back to back
(``offsets``/``sizes``, as the manifest says): a ``/dev/shm`` segment of the publisher's
:class:`~tiersync.weights.segment.SegmentPool` (same-host samplers read it in place) or
anonymous memory. A version begins once the GETs of the old one finished, in a segment no
zero-copy sampler still reads. Tensors are written in order, each in parts of :data:`PART`
bytes; a span of tensor ``i`` is served (:meth:`provide`, the
:class:`~tiersync.weights.serving.SpanService` provider) once the parts it reaches into were
written (until then the provider answers a :data:`~tiersync.net.service.Watch` of the last
one, and the GET's session is parked without a server worker: writing a part wakes only the
GETs that waited for it, and a version keeps no wake lists when nothing waits; the first GETs
of a large embedding go out after its first part, not after all of it), and the checksums of
its spans are composed from sums taken while it was copied in (:meth:`span_sum`,
:class:`~tiersync.weights.piece_sums.PieceSums`). It works under the publisher's condition,
the lock the pool is called under.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from functools import partial

import numpy as np

from tiersync.errors import ClosedError, RemoteError, UsageError
from tiersync.net.service import Watch
from tiersync.weights.piece_sums import PieceSums, span_sum
from tiersync.weights.segment import SegmentPool, SegmentWriter
from tiersync.weights.spans import StridedSpan

__all__ = ["PART", "PublishBuffer"]

PART = 4 << 20
"""Bytes of a tensor written before the GETs of them are answered (a multiple of
:data:`~tiersync.weights.piece_sums.PIECE`)."""


class PublishBuffer:
    """Tensor ``i`` (``index``: name -> i) at ``offsets[i]`` (file offsets: the first is the
    payload's start), ``sizes[i]`` bytes; ``payload`` bytes in all, in ``pool`` (None: memory)."""

    def __init__(
        self,
        cond: threading.Condition,
        pool: SegmentPool | None,
        index: Mapping[str, int],
        offsets: list[int],
        sizes: list[int],
        payload: int,
    ) -> None:
        self._cond, self._pool, self._index = cond, pool, index
        self._offsets, self._sizes, self._payload = offsets, sizes, payload
        self._current: int | None = None  # version GETs may read
        self._filled = [0] * len(sizes)  # bytes of tensor i of this version written
        self._inflight = 0
        self._waits: dict[tuple[int, int], list[Callable[[], object]]] = {}  # (i, k): wakes of part k's GETs
        self._sums = PieceSums(len(sizes))
        if pool is not None:
            self._store = self._segment_store(pool, -1, set())
            try:
                _current(pool).reserve()
            except BaseException:  # no room: the publisher is not made, and leaves no file behind
                self._store = np.zeros(0, np.uint8)
                pool.close()
                raise
        else:
            self._store = np.zeros(payload, np.uint8)

    @property
    def segment_path(self) -> str | None:
        return None if self._pool is None else _current(self._pool).path

    def _segment_store(self, pool: SegmentPool, version: int, holders: set[object]) -> np.ndarray:
        """Switch to the pool's segment for ``version`` (held by ``holders``): its payload view."""
        self._store = np.zeros(0, np.uint8)  # drop the old view before the pool may unmap it
        seg = pool.take(version, holders)
        return seg.region(self._offsets[0], self._payload) if self._payload else np.zeros(0, np.uint8)

    def begin(self, version: int, holders: set[object], timeout: float) -> None:
        """Refuse GETs of the old version, let the running ones be answered (at most ``timeout``
        s; a pinned answer is read later: a sampler still reading the old version then refuses
        the bytes that changed), mark the new one (in a segment no zero-copy sampler still
        reads; ``holders`` still ``alive`` then hold it from now: one dropped while this waited
        would never release it)."""
        end = time.monotonic() + timeout
        with self._cond:
            self._current, self._filled = None, [0] * len(self._sizes)
            self._sums.reset()
            waits, self._waits = self._waits, {}
        for wakes in waits.values():  # GETs waiting for the old version are refused now
            for wake in wakes:
                wake()
        with self._cond:
            while self._inflight and time.monotonic() < end:
                self._cond.wait(end - time.monotonic())
            if self._pool is not None:
                live = {h for h in holders if getattr(h, "alive", True)}
                self._store = self._segment_store(self._pool, version, live)
                _current(self._pool).begin(version)
            self._current = version
        if self._pool is not None:  # a new segment's pages, outside the lock: seconds for gigabytes
            try:
                _current(self._pool).reserve()
            except BaseException:  # no room: the version never starts, so nobody holds it
                self.abandon(version, holders)
                raise

    def abandon(self, version: int, holders: set[object]) -> None:
        """``version`` will not be announced after all: ``holders`` hold its segment no more."""
        if self._pool is not None:
            with self._cond:
                for holder in holders:
                    self._pool.release(holder, version)

    def write(self, i: int, src: np.ndarray) -> None:
        """Copy tensor ``i``'s bytes ``src`` (flat uint8) in, part by part (summing its pieces on
        the way); the GETs of each part are answered once it is there."""
        dst = self._store[self._offsets[i] - self._offsets[0] :][: self._sizes[i]]
        for k in range(max(1, -(-self._sizes[i] // PART))):
            lo, hi = k * PART, min(self._sizes[i], (k + 1) * PART)
            self._sums.copy_in(i, dst[lo:hi], src[lo:hi], lo)
            with self._cond:
                self._filled[i] = hi
                wakes = self._waits.pop((i, k), ())
            for wake in wakes:  # only the GETs waiting for this part
                wake()

    def complete(self, version: int) -> None:
        """Every tensor of ``version`` is written (the segment's header says so)."""
        if self._pool is not None:
            _current(self._pool).complete(version)

    def provide(
        self, version: int, name: str, key: tuple[int, ...], span: StridedSpan | None
    ) -> tuple[np.ndarray, Callable[[], None]] | Watch:
        """GETs: tensor ``name`` of ``version`` once the bytes ``span`` reaches into were written
        (all of them for None), any ``key``; until then a Watch of the part they end in.
        RemoteError once ``version`` is not the one served."""
        i = self._index.get(name)
        if i is None:
            raise UsageError(f"unknown tensor {name!r}", argument="tensor")
        need = self._sizes[i] if span is None else min(span.extent, self._sizes[i])  # past the end: refused later
        with self._cond:
            if self._current != version:
                raise RemoteError("version not being served", version=version, current=self._current)
            if self._filled[i] < need:
                return partial(self._watch, version, i, need)
            self._inflight += 1
            lo = self._offsets[i] - self._offsets[0]
            return self._store[lo : lo + self._sizes[i]], self._release

    def _watch(self, version: int, i: int, need: int, wake: Callable[[], object]) -> None:
        """Call ``wake`` once ``need`` bytes of tensor ``i`` are written or ``version`` ended."""
        with self._cond:
            if self._current == version and self._filled[i] < need:
                self._waits.setdefault((i, max(0, need - 1) // PART), []).append(wake)
                return
        wake()

    def serving(self, version: int) -> bool:
        """Whether GETs of ``version`` are answered (no later version has begun)."""
        with self._cond:
            return self._current == version

    def span_sum(self, version: int, name: str, span: StridedSpan) -> int | None:
        """tsum64 of ``span`` of tensor ``name`` of ``version`` from the sums taken while it was
        written; None when that is not known (another version, not written, or a span
        :class:`~tiersync.weights.piece_sums.PieceSums` cannot compose): sum the bytes."""
        i = self._index.get(name)
        with self._cond:
            if i is None or self._current != version or self._filled[i] < span.extent:
                return None
            lo = self._offsets[i] - self._offsets[0]
            flat, states = self._store[lo : lo + self._filled[i]], self._sums.of(i, self._filled[i])
        return span_sum(states, flat, span)

    def _release(self) -> None:
        with self._cond:
            self._inflight -= 1
            if not self._inflight:  # only begin() waits on this count
                self._cond.notify_all()

    def close(self) -> None:
        """Unmap and unlink the segments (nothing to do in memory)."""
        if self._pool is not None:
            with self._cond:
                self._store = np.zeros(0, np.uint8)
                self._pool.close()


def _current(pool: SegmentPool) -> SegmentWriter:
    """The segment the pool handed out last (the buffer takes one on construction; None only
    once the pool is closed)."""
    seg = pool.current
    if seg is None:
        raise ClosedError("the publisher's segments are closed", argument="publisher")
    return seg
