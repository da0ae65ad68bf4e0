"""Async block copies between a KV layout's pools ("device") and a host arena.

Lifecycle: build once with a layout and an arena (``TransferEngine(layout,
arena)``), post copies (``d2h`` / ``h2d`` / ``d2h_auto_allocate``) which return
:class:`~tiersync.transfer.future.TransferFuture` at once, poll or wait, and
``close`` (idempotent). A request is validated whole before anything moves; a
refused request changes nothing.

Host blocks a transfer touches must stay LOCKED (``arena.allocate`` or
``arena.allocator.lock``) until its future is done: the engine checks this at
submission and never locks or unlocks on the caller's behalf, except for
``d2h_auto_allocate``, whose blocks come back locked for the caller to
``unlock`` later (then LRU may evict them).

Each request is cut per pool (layer order) into chunks of at most
``chunk_bytes`` (smaller for a small request, so that every worker has a share); a
dispatcher thread admits chunks under the :class:`Pacer`
(bytes in flight, optional bandwidth cap) and a pool of ``workers`` threads
copies them with the GIL released.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from tiersync.errors import ClosedError, UsageError, check_positive_int
from tiersync.layout.pool import Device, KVLayout, Region
from tiersync.telemetry.metrics import Metrics
from tiersync.tiers.host import HostArena
from tiersync.transfer.backends import CopyBackend, backend_for
from tiersync.transfer.future import Direction, TransferFuture
from tiersync.transfer.pacing import Pacer
from tiersync.transfer.spans import (
    BlockCopy,
    Pattern,
    block_copy,
    expand,
    pool_pattern,
    validate_runs,
)

_MIN_PIECE = 1 << 20
_Part = tuple[int, int, int, int, BlockCopy]  # (pool index, layer, source address, destination address, spans)


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """``workers`` copy threads; ``max_inflight_bytes`` admitted at once; ``bandwidth_gbps``
    caps the rate (decimal GB/s, None = no cap); ``chunk_bytes`` is the unit of work."""

    workers: int = 2
    max_inflight_bytes: int = 256 << 20
    bandwidth_gbps: float | None = None
    chunk_bytes: int = 8 << 20
    streaming_stores: bool = True
    backend: str | None = None
    """Copy backend by name (``native``, ``python-memmove``); None picks per pool device."""

    def __post_init__(self) -> None:
        for name in ("workers", "max_inflight_bytes", "chunk_bytes"):
            check_positive_int(getattr(self, name), f"TransferConfig.{name}")
        if self.backend is not None and (not isinstance(self.backend, str) or not self.backend):
            raise UsageError("must be a backend name or None", argument="TransferConfig.backend")
        bw = self.bandwidth_gbps
        if bw is not None and (not isinstance(bw, (int, float)) or isinstance(bw, bool) or not bw > 0):
            raise UsageError("must be positive or None", argument="TransferConfig.bandwidth_gbps")


@dataclass(frozen=True, slots=True)
class _Chunk:
    """One work item: parts ``(pool, layer, src_addr, dst_addr, spans)`` copied in order."""

    future: TransferFuture
    parts: tuple[_Part, ...]
    nbytes: int


class TransferEngine:
    """Moves blocks between ``layout``'s pools and ``arena``. Thread-safe."""

    def __init__(
        self,
        layout: KVLayout,
        arena: HostArena,
        config: TransferConfig | None = None,
        *,
        metrics: Metrics | None = None,
    ) -> None:
        if not isinstance(layout, KVLayout):
            raise UsageError("must be a KVLayout", argument="layout", got=type(layout).__name__)
        if not isinstance(arena, HostArena):
            raise UsageError("must be a HostArena", argument="arena", got=type(arena).__name__)
        if arena.block_nbytes < layout.host_block_nbytes:
            raise UsageError(
                "host blocks are smaller than the layout's host image",
                argument="arena",
                block_nbytes=arena.block_nbytes,
                needed=layout.host_block_nbytes,
            )
        self.config = config if config is not None else TransferConfig()
        self.backends = _backends(layout, self.config)
        """The copy backend of each device the layout's pools live on."""
        self.layout, self.arena = layout, arena
        groups: dict[tuple[int, tuple[Region, ...]], int] = {}  # equal stride and regions: one span plan
        self._geometry = [groups.setdefault((p.spec.block_stride, p.spec.regions), len(groups)) for p in layout.pools]
        self._patterns: dict[tuple[int, bool], tuple[int, Pattern]] = {}  # (geometry, to_host) -> stride, pattern
        for g, p in zip(self._geometry, layout.pools):
            for to_host in (True, False):
                self._patterns.setdefault((g, to_host), (p.spec.block_stride, pool_pattern(p.spec, to_host=to_host)))
        self.metrics = metrics if metrics is not None else Metrics.default()
        rate = None if self.config.bandwidth_gbps is None else self.config.bandwidth_gbps * 1e9
        self._pacer = Pacer(self.config.max_inflight_bytes, rate)
        self._pool = ThreadPoolExecutor(self.config.workers, thread_name_prefix="tiersync-copy")
        self._queue: queue.SimpleQueue[list[_Chunk] | None] = queue.SimpleQueue()
        self._closed = False
        self._queued = 0  # work lists put on the queue and not yet fully dispatched
        self._state_lock = threading.Lock()  # orders posts against close: no work after the stop marker
        self._host_memory: np.ndarray | None = arena.memory  # keeps the arena's mapping alive while copies may touch it
        self._dispatcher = threading.Thread(target=self._dispatch, name="tiersync-dispatch", daemon=True)
        self._dispatcher.start()

    def __repr__(self) -> str:
        return (
            f"<TransferEngine pools={len(self.layout.pools)} blocks={self.layout.num_blocks} "
            f"host={self.arena.num_blocks} inflight={self._pacer.inflight} B>"
        )

    # -- posting ------------------------------------------------------------
    def d2h(self, runs: Iterable[Sequence[int]]) -> TransferFuture:
        """Copy ``(device_block, host_block, count)`` runs device -> host."""
        arr = validate_runs(runs, src_blocks=self.layout.num_blocks, dst_blocks=self.arena.num_blocks)
        return self._post(arr, Direction.D2H)

    def h2d(self, runs: Iterable[Sequence[int]]) -> TransferFuture:
        """Copy ``(host_block, device_block, count)`` runs host -> device."""
        arr = validate_runs(runs, src_blocks=self.arena.num_blocks, dst_blocks=self.layout.num_blocks)
        for i, p in enumerate(self.layout.pools):
            if not p.writable:
                raise UsageError("pool is read-only", argument=f"layout.pools[{i}]", tag=p.spec.tag)
        return self._post(arr, Direction.H2D)

    def d2h_auto_allocate(self, device_blocks: Sequence[int]) -> TransferFuture:
        """Copy ``device_blocks`` into host blocks the arena picks (free first, then LRU).

        ``future.host_blocks[i]`` receives ``device_blocks[i]``; they stay LOCKED
        until :meth:`unlock`. Raises CapacityError (nothing allocated) when full.
        """
        if isinstance(device_blocks, (str, bytes)) or not hasattr(device_blocks, "__iter__"):
            raise UsageError(
                "must be a sequence of device block ids", argument="device_blocks", got=type(device_blocks).__name__
            )
        ids = list(device_blocks)
        validate_runs(
            [(d, i, 1) for i, d in enumerate(ids)],
            src_blocks=self.layout.num_blocks,
            dst_blocks=max(len(ids), 1),
            argument="device_blocks",
        )
        self._check_open()
        host = self.arena.allocate(len(ids))
        try:
            return self._post(np.array([(d, h, 1) for d, h in zip(ids, host)], dtype=np.int64), Direction.D2H)
        except BaseException:
            self.arena.free(host)  # they hold nothing: back to FREE, not CACHED
            raise

    def unlock(self, host_blocks: Sequence[int]) -> None:
        """Drop the caller's lock on host blocks; unlocked blocks become evictable."""
        self.arena.allocator.unlock(host_blocks)

    def _post(self, runs: np.ndarray, direction: Direction) -> TransferFuture:
        self._check_open()
        self.arena.check_open()
        to_host = direction is Direction.D2H
        host_first = runs[:, 1] if to_host else runs[:, 0]
        host_ids = expand(host_first, runs[:, 2])
        if not self.arena.allocator.all_locked(host_ids):
            raise UsageError("host blocks must be locked for the whole transfer", argument="runs")
        parts, piece = self._plan(runs, to_host)
        per_layer = [0] * self.layout.num_layers
        for _, layer, _, _, _ in parts:
            per_layer[layer] += 1
        fut = TransferFuture(direction, sum(p[4].nbytes for p in parts), per_layer, host_ids.tolist())
        work = [_Chunk(fut, tuple(group), sum(p[4].nbytes for p in group)) for group in self._pack(parts, piece)]
        with self._state_lock:
            self._check_open()
            if self._queued == 0:  # nothing ahead of it: what fits now skips the dispatcher's hop
                work = self._admit_now(work)
            if work:
                self._queued += 1
                self._queue.put(work)
        return fut

    def _admit_now(self, work: list[_Chunk]) -> list[_Chunk]:
        """Submit the leading chunks the pacer admits without waiting; return the rest, in
        order, for the dispatcher. Called under ``_state_lock`` with no work queued."""
        for i, chunk in enumerate(work):
            if not self._pacer.try_acquire(chunk.nbytes):
                return work[i:]
            self._submit(chunk)
        return []

    def _submit(self, chunk: _Chunk) -> None:
        """Hand an admitted chunk to the copy pool (its bytes back, its future failed, when
        ``close(wait=False)`` shut the pool down)."""
        try:
            self._pool.submit(self._run, chunk)
        except RuntimeError:
            self._pacer.release(chunk.nbytes)
            chunk.future._fail(ClosedError("transfer engine closed before the copy ran"))

    def _plan(self, runs: np.ndarray, to_host: bool) -> tuple[list[_Part], int]:
        """(pool, layer, src_addr, dst_addr, spans) parts in layer order, and the piece size
        they were cut to (:meth:`_piece_bytes`). Block offsets are computed once per distinct
        pool geometry (its region pattern once per engine), relative to the pool's first block
        and its host segment; the per-pool offsets go into the two base addresses."""
        spans: dict[int, BlockCopy] = {}
        for geo in self._geometry:
            if geo not in spans:
                stride, pattern = self._patterns[(geo, to_host)]
                spans[geo] = block_copy(pattern, stride, self.arena.block_nbytes, runs, to_host=to_host)
        piece = self._piece_bytes(sum(spans[geo].nbytes for geo in self._geometry))
        pieces = {geo: sp.split(piece) for geo, sp in spans.items()}
        parts: list[_Part] = []
        for i, (p, off) in enumerate(zip(self.layout.pools, self.layout.host_offsets)):
            dev = p.address + p.spec.base_offset
            host = self.arena.address + off
            src, dst = (dev, host) if to_host else (host, dev)
            parts.extend((i, p.layer, src, dst, sp) for sp in pieces[self._geometry[i]])
        return parts, piece

    def _piece_bytes(self, total: int) -> int:
        """Work-item size for a request of ``total`` bytes: ``chunk_bytes``, or less so that
        every worker gets a share of a smaller request (one 8 MiB item would leave the other
        workers idle), but not below _MIN_PIECE (each item costs a thread hand-off)."""
        share = -(-total // self.config.workers)
        return max(min(self.config.chunk_bytes, share), min(_MIN_PIECE, self.config.chunk_bytes))

    @staticmethod
    def _pack(parts: list[_Part], piece: int) -> list[list[_Part]]:
        """Group consecutive parts into work items of about ``piece`` bytes each."""
        groups: list[list[_Part]] = []
        size = piece
        for part in parts:
            if groups and size + part[4].nbytes <= piece:
                groups[-1].append(part)
                size += part[4].nbytes
            else:
                groups.append([part])
                size = part[4].nbytes
        return groups

    # -- execution ----------------------------------------------------------
    def _dispatch(self) -> None:
        while True:
            work = self._queue.get()
            if work is None:
                return
            for chunk in work:
                if chunk.future.done():
                    continue  # failed earlier: skip the rest of it
                try:
                    self._pacer.acquire(chunk.nbytes)
                except ClosedError as exc:
                    chunk.future._fail(exc)
                    continue
                self._submit(chunk)
            with self._state_lock:
                self._queued -= 1

    def _run(self, chunk: _Chunk) -> None:
        """Copy the chunk's parts; its bytes go back to the pacer before the future settles,
        so the waiter wakes to an engine that admits its next request at once."""
        fut, last, error = chunk.future, False, None
        try:
            for pool, layer, src, dst, spans in chunk.parts:
                if fut.done():
                    break  # failed elsewhere
                backend = self.backends[self.layout.pools[pool].device]
                backend.copy(src, dst, spans)
                backend.synchronize()  # the layer may be reported done only once its bytes landed
                last = fut._chunk_done(layer)
        except BaseException as exc:  # noqa: BLE001 - delivered through the future
            error = exc
        self._pacer.release(chunk.nbytes)
        if error is not None and fut._fail(error):
            self._record(fut, ok=False)
        elif error is None and last and fut._settle(None):
            self._record(fut, ok=True)

    def _record(self, fut: TransferFuture, *, ok: bool) -> None:
        if ok:
            self.metrics.transfer_done(fut.direction.value, fut.nbytes, fut.seconds or 0.0)
        else:
            self.metrics.transfer_failed(fut.direction.value)

    # -- lifecycle ----------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("transfer engine is closed")

    def close(self, wait: bool = True) -> None:
        """Stop accepting work; with ``wait`` finish what was posted. Idempotent."""
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        if wait:
            self._dispatcher.join()
        self._pool.shutdown(wait=wait)
        self._pacer.close()
        if wait:
            self._host_memory = None  # no copy can touch the arena any more

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _backends(layout: KVLayout, config: TransferConfig) -> dict[Device, CopyBackend]:
    """One backend per device of ``layout``'s pools (UsageError when a device has none)."""
    return {
        d: backend_for(d, name=config.backend, streaming=config.streaming_stores)
        for d in sorted(layout.devices, key=lambda d: d.value)
    }
