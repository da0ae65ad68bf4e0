"""A trainer shard's version buffer: where each version is written and GETs read it.

:class:`PublishBuffer` holds the shard's tensors of the version being published back to back
(``offsets``/``sizes``, as the manifest says): a ``/dev/shm`` segment of the publisher's
:class:`~tiersync.weights.segment.SegmentPool` (same-host samplers read it in place) or
anonymous memory. A version begins once the GETs of the old one finished, in a segment no
zero-copy sampler still reads; tensor ``i`` is served (:meth:`provide`, the
:class:`~tiersync.weights.serving.SpanService` provider) once it was written (a GET waiting for
it sleeps on that tensor's event, so writing one tensor wakes only the GETs of that one), and the
checksums of its spans are composed from sums taken while it was copied in (:meth:`span_sum`,
:class:`~tiersync.weights.piece_sums.PieceSums`). It works under the publisher's condition,
the lock the pool is called under.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping

import numpy as np

from tiersync.errors import ClosedError, RemoteError, UsageError
from tiersync.weights.piece_sums import PieceSums, span_sum
from tiersync.weights.segment import SegmentPool, SegmentWriter
from tiersync.weights.spans import StridedSpan

__all__ = ["PublishBuffer"]


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
        self._ready = 0
        self._inflight = 0
        self._written = [threading.Event() for _ in sizes]  # this version's tensor i was written
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
        """Refuse GETs of the old version, let the running ones finish (at most ``timeout`` s),
        mark the new one (in a segment no zero-copy sampler still reads; ``holders`` hold it from now)."""
        end = time.monotonic() + timeout
        with self._cond:
            self._current, self._ready = None, 0
            self._sums.reset()
            for event in self._written:  # GETs waiting for the old version give up now
                event.set()
            self._written = [threading.Event() for _ in self._sizes]
            while self._inflight and time.monotonic() < end:
                self._cond.wait(end - time.monotonic())
            if self._pool is not None:
                self._store = self._segment_store(self._pool, version, holders)
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
        """Copy tensor ``i``'s bytes ``src`` in (summing its pieces on the way); GETs of it are
        answered from now."""
        self._sums.copy_in(i, self._store[self._offsets[i] - self._offsets[0] :][: self._sizes[i]], src)
        with self._cond:
            newly, self._ready = self._written[self._ready : i + 1], i + 1
            for event in newly:  # only those not set yet (each set takes a lock and wakes waiters)
                event.set()

    def complete(self, version: int) -> None:
        """Every tensor of ``version`` is written (the segment's header says so)."""
        if self._pool is not None:
            _current(self._pool).complete(version)

    def provide(
        self, version: int, name: str, key: tuple[int, ...], span: object, timeout: float
    ) -> tuple[np.ndarray, Callable[[], None]]:
        """GETs: tensor ``name`` of ``version`` once written (waiting at most ``timeout`` s); any
        ``key`` and ``span`` of it (the whole tensor is written)."""
        i = self._index.get(name)
        if i is None:
            raise UsageError(f"unknown tensor {name!r}", argument="tensor")
        end = time.monotonic() + timeout
        while True:
            with self._cond:
                if self._current == version and self._ready > i:
                    self._inflight += 1
                    break
                written = self._written[i]
                if self._current != version or time.monotonic() >= end:
                    raise RemoteError(
                        "version not being served (or not written in time)", version=version, current=self._current
                    )
            written.wait(end - time.monotonic())  # set when tensor i is written or the version ends
        lo = self._offsets[i] - self._offsets[0]
        return self._store[lo : lo + self._sizes[i]], self._release

    def span_sum(self, version: int, name: str, span: StridedSpan) -> int | None:
        """tsum64 of ``span`` of tensor ``name`` of ``version`` from the sums taken while it was
        written; None when that is not known (another version, not written, or a span
        :class:`~tiersync.weights.piece_sums.PieceSums` cannot compose): sum the bytes."""
        i = self._index.get(name)
        with self._cond:
            if i is None or self._current != version or self._ready <= i:
                return None
            lo = self._offsets[i] - self._offsets[0]
            flat, states = self._store[lo : lo + self._sizes[i]], self._sums.of(i)
        return span_sum(states, flat, span)

    def _release(self) -> None:
        with self._cond:
            self._inflight -= 1
            if not self._inflight:  # only begin() waits on this count: GETs waiting in provide stay asleep
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
