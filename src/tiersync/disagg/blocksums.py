"""Checksums of a request's blocks for its readers, computed as each layer becomes ready.

A same-host reader copies the regions a producer names and verifies each against the tsum64
the producer sends with it; a TCP reader verifies each DATA against the checksum in its
header. Summing the bytes when a pull arrives puts a full pass over them on the read path (on
a small host it also competes with the reader's copying threads). A producer that has served
a reader therefore sums every block region of a request on its own thread as soon as the
layer is ready (``layer_ready``: the bytes are final from then on, the producer's contract),
keeping each region's tsum64 and its partial state, and answers a pull from those: a
same-host pull with the regions' sums, a TCP pull's DATA with their states composed into the
checksum of the pull's bytes (:meth:`BlockSums.composed`; a region cut by the pull is summed
alone). A pull is cut at block
boundaries so its regions are whole blocks wherever the route allows; a region that is not a
whole block is summed when asked; a pull for a layer whose sums are not done yet sums the
layer's blocks itself (or waits for the thread already summing them): never twice. A block changed
after ``layer_ready`` fails the reader's check: it is refused, never delivered.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import numpy as np

from tiersync.disagg.config import RequestState
from tiersync.disagg.geometry import KVOrder, PagedKVLayout
from tiersync.net import local
from tiersync.transfer import kernel

__all__ = ["BlockSums", "LayerSums", "region_unit"]

log = logging.getLogger(__name__)


def region_unit(layout: PagedKVLayout) -> int:
    """Bytes of one summed block region of ``layout`` (a block's K and V together, or each of
    them in a KV-major layout): a producer cuts a same-host pull's regions at these."""
    return layout.block_nbytes * (1 if layout.order is KVOrder.KV_MAJOR else 2)


class _Request(Protocol):
    """What :class:`BlockSums` reads and fills of a request (a producer's
    :class:`~tiersync.disagg.layer_reads.Outgoing`)."""

    @property
    def block_ids(self) -> Sequence[int]: ...

    @property
    def views(self) -> Sequence[np.ndarray]: ...

    @property
    def sums(self) -> dict[int, LayerSums]: ...

    @property
    def state(self) -> RequestState: ...


class BlockSums:
    """Per-layer sums of whole block regions (``unit`` bytes each, at multiples of ``unit`` in
    the layer: a block's K and V together, or each of them in a KV-major layer)."""

    def __init__(self, layout: PagedKVLayout, threads: int) -> None:
        self.unit = region_unit(layout)
        self._kv_major = layout.order is KVOrder.KV_MAJOR
        self._v_base = layout.num_blocks * layout.block_nbytes
        self._threads = threads
        self._queue: queue.SimpleQueue[tuple[_Request, int] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._busy: dict[tuple[int, int], threading.Event] = {}  # (request, layer) being summed -> done

    @property
    def enabled(self) -> bool:
        return self._thread is not None

    def enable(self) -> None:
        """From now on sum each ready layer ahead of its pulls (idempotent). Nothing changes
        without the native checksum: pulls are then summed by the stack as they are sent."""
        if kernel.TSUM64 is None:
            return
        with self._lock:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="tiersync-kv-sums", daemon=True)
                self._thread.start()

    def close(self) -> None:
        """Stop summing ahead (from now on a pull sums what it needs) and wait, at most 10 s, for
        the thread to sum the layers already queued and end: it then holds no request's buffers,
        so none is freed on it while the interpreter shuts down (freeing torch-owned memory
        there aborts the process). Idempotent."""
        with self._lock:
            thread, self._thread, self._closed = self._thread, None, True
        if thread is None:
            return
        self._queue.put(None)
        if thread is not threading.current_thread():
            thread.join(timeout=10)
            if thread.is_alive():
                log.warning("the block-summing thread did not end within 10 s of close")

    def submit(self, req: _Request, layer: int) -> None:
        """Sum ``req``'s blocks in ``req.views[layer]`` (sets ``req.sums[layer]``) when enabled."""
        if self.enabled:
            self._queue.put((req, layer))

    def known(self, req: _Request, layer: int) -> LayerSums | None:
        """The layer's block sums for a pull: done already, or being summed on the thread (then
        waited for), or summed now on the caller's thread when enabled (the thread then skips
        the layer): a layer is never summed twice. None when not enabled (the pull sums what it sends)."""
        if not self.enabled:
            return req.sums.get(layer)
        self._sum_once(req, layer)
        return req.sums.get(layer)

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            if job[0].state is not RequestState.PENDING:  # read, dropped or timed out: its buffers may be reused
                continue
            try:
                self._sum_once(*job)
            except Exception:  # that layer is summed when pulled; the thread goes on
                log.exception("summing a layer ahead of its pulls failed")
            del job  # a finished request is not kept alive while the thread waits for the next

    def _sum_once(self, req: _Request, layer: int) -> None:
        with self._lock:
            if layer in req.sums:
                return
            busy = self._busy.get((id(req), layer))
            if busy is None:
                busy = self._busy[id(req), layer] = threading.Event()
                mine = True
            else:
                mine = False
        if not mine:
            busy.wait()
            return
        try:
            req.sums[layer] = self._layer_sums(req, layer)
        finally:
            with self._lock:
                del self._busy[id(req), layer]
            busy.set()

    def _layer_sums(self, req: _Request, layer: int) -> LayerSums:
        ids = np.asarray(req.block_ids, np.int64)
        offs = ids * self.unit if not self._kv_major else np.concatenate([ids, ids]) * self.unit
        if self._kv_major:
            offs[len(ids) :] += self._v_base
        states = np.zeros((len(offs), kernel.PARTIAL_BYTES // 8), np.uint64)
        sums = local.sum_ranges(
            req.views[layer], _ints(offs), _ints(np.full(len(offs), self.unit, np.int64)), self._threads, states
        )
        order = np.argsort(offs)
        return LayerSums(offs[order], np.asarray(sums, np.uint64)[order], states[order].tobytes())

    def composed(self, view: np.ndarray, known: LayerSums | None, offs: np.ndarray, lens: np.ndarray) -> int | None:
        """tsum64 of the spans ``(offs, lens)`` of ``view`` back to back (a TCP pull's payload):
        each whole block region's state from ``known``, any other piece summed alone. None
        when it cannot be composed (nothing known, no native checksum, or a piece other than
        the last is not a whole number of 64-byte stripes): the stack sums the bytes."""
        if known is None or not len(known) or kernel.TSUM64 is None:
            return None
        offs, lens = _cut(np.asarray(offs, np.int64), np.asarray(lens, np.int64), self.unit)
        if len(lens) > 1 and (lens[:-1] % kernel.STRIPE).any():
            return None
        at = np.minimum(np.searchsorted(known.offsets, offs), len(known) - 1)
        kept = np.where((known.offsets[at] == offs) & (lens == self.unit), at, -1)  # a whole summed block
        return kernel.compose_pieces(view, zip(offs.tolist(), lens.tolist(), kept.tolist()), known.states)

    def regions(
        self, view: np.ndarray, known: LayerSums | None, offs: np.ndarray, lens: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The spans ``(offs, lens)`` of ``view`` cut at block boundaries, with each piece's tsum64
        (from ``known`` where it is a whole summed block, else computed now), all as arrays."""
        offs, lens = _cut(np.asarray(offs, np.int64), np.asarray(lens, np.int64), self.unit)
        sums = np.zeros(len(offs), np.uint64)
        have = np.zeros(len(offs), bool)
        if known is not None and len(known):
            at = np.minimum(np.searchsorted(known.offsets, offs), len(known) - 1)
            have = (known.offsets[at] == offs) & (lens == self.unit)
            sums[have] = known.values[at[have]]
        todo = np.flatnonzero(~have)
        if todo.size:
            sums[todo] = local.sum_ranges(view, _ints(offs[todo]), _ints(lens[todo]), self._threads)
        return offs, lens, sums


@dataclass(frozen=True, slots=True)
class LayerSums:
    """One layer's block sums: ``values[i]`` is the tsum64 of the block region at ``offsets[i]``
    (sorted), ``unit`` bytes long, and ``states[P * i : P * (i + 1)]`` its partial state
    (``kernel.tsum64_partial``'s bytes; P is :data:`~tiersync.transfer.kernel.PARTIAL_BYTES`)."""

    offsets: np.ndarray
    values: np.ndarray
    states: bytes

    def __len__(self) -> int:
        return len(self.offsets)


def _ints(array: np.ndarray) -> Sequence[int]:
    """An int64 array as the ``Sequence[int]`` :func:`~tiersync.net.local.sum_ranges` is typed
    to take, not converted: it only iterates it or hands it to ``np.asarray``."""
    return cast("Sequence[int]", array)


def _cut(offs: np.ndarray, lens: np.ndarray, unit: int) -> tuple[np.ndarray, np.ndarray]:
    """Spans split wherever they cross a multiple of ``unit``."""
    if not len(offs):
        return offs, lens
    ends = offs + lens
    first, last = offs // unit, (ends - 1) // unit
    counts = np.where(lens > 0, last - first + 1, 1)
    if (counts == 1).all():
        return offs, lens
    idx = np.repeat(np.arange(len(offs)), counts)
    k = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    unit_start = (first[idx] + k) * unit
    starts = np.maximum(offs[idx], unit_start)
    stops = np.minimum(ends[idx], unit_start + unit)
    return starts, stops - starts
