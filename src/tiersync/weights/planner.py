"""The RL weight-sync resharding planner: trainer shards -> sampler shards.

:func:`plan_transfer` turns a source layout (the trainer's shardings), a destination
layout (the sampler's) and a set of named tensors into a :class:`TransferPlan`:

1. Shard boxes follow :mod:`tiersync.weights.sharding` (``global // n`` per dimension, the
   remainder to the last shard). Source and destination boxes are intersected dimension by
   dimension, so the work is proportional to the number of chunks, not to the square of
   the number of ranks.
2. Each chunk has candidate pushers (the source replicas holding it) and receivers (the
   destination replicas needing it). Chunks are handled largest first and every push goes
   to the candidate that has sent the fewest bytes so far (ties: lowest rank), a
   deterministic longest-processing-time greedy; the reference's
   ``candidates[dst_index % len(candidates)]`` ignores load and can pile bytes on one rank.
3. A chunk needed by more than ``fanout`` receivers is sent by the pushers to ``fanout``
   of them; each receiver then relays to up to ``fanout`` more, stage by stage (depth about
   ``log_fanout(receivers)``). Receiver order is rotated per chunk so the relay work is
   spread over the destination ranks.

Plans are cached: equal inputs return the same plan object (see :class:`PlanCache`).
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from tiersync.errors import UsageError
from tiersync.weights.sharding import Box, Sharding, dim_intervals, replica_groups
from tiersync.weights.spans import box_span
from tiersync.weights.transfer_plan import PlanOptions, TensorSpec, Transfer, TransferKind, TransferPlan

__all__ = ["PlanCache", "default_plan_cache", "plan_transfer"]

Layout = Sharding | Mapping[str, Sharding]
NamedSpecs = tuple[tuple[str, TensorSpec], ...]
NamedShardings = tuple[tuple[str, Sharding], ...]


class PlanCache:
    """A thread-safe LRU of plans keyed by (source, destination, tensors, options).

    ``maxsize`` (>= 1) bounds the number of plans kept. ``hits``/``misses`` count lookups.
    """

    def __init__(self, maxsize: int = 64) -> None:
        if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 1:
            raise UsageError("must be an int >= 1", argument="maxsize", value=maxsize)
        self._maxsize = maxsize
        self._plans: OrderedDict[Hashable, TransferPlan] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get_or_build(self, key: Hashable, build: Callable[[], TransferPlan]) -> TransferPlan:
        """The plan cached under ``key``, building (outside the lock) and storing it if absent."""
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
                self.hits += 1
                return plan
            self.misses += 1
        plan = build()
        with self._lock:
            plan = self._plans.setdefault(key, plan)
            self._plans.move_to_end(key)
            while len(self._plans) > self._maxsize:
                self._plans.popitem(last=False)
        return plan

    def clear(self) -> None:
        """Drop every cached plan."""
        with self._lock:
            self._plans.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._plans)


_DEFAULT_CACHE = PlanCache()


def default_plan_cache() -> PlanCache:
    """The process-wide cache :func:`plan_transfer` uses unless told otherwise."""
    return _DEFAULT_CACHE


def plan_transfer(
    source: Layout,
    destination: Layout,
    tensors: Mapping[str, TensorSpec | tuple[Any, Any]],
    options: PlanOptions | None = None,
    *,
    cache: PlanCache | None = _DEFAULT_CACHE,
) -> TransferPlan:
    """Plan moving ``tensors`` from the ``source`` layout to the ``destination`` layout.

    ``source``/``destination``: one :class:`Sharding` for every tensor, or a mapping from
    tensor name to sharding (names beyond ``tensors`` are ignored). ``tensors``: name ->
    :class:`TensorSpec` or ``(shape, dtype)``. ``cache=None`` bypasses caching.
    Raises :class:`UsageError` naming the bad argument (``tensors``, ``source``,
    ``destination``, ``options``, ``cache``).
    """
    options = PlanOptions() if options is None else options
    if not isinstance(options, PlanOptions):
        raise UsageError("expected PlanOptions", argument="options", value=options)
    specs = _normalise_tensors(tensors)
    src = _normalise_layout(source, specs, "source")
    dst = _normalise_layout(destination, specs, "destination")
    if cache is None:
        return _build(src, dst, specs, options)
    if not isinstance(cache, PlanCache):
        raise UsageError("expected a PlanCache or None", argument="cache", value=cache)
    return cache.get_or_build((src, dst, specs, options), lambda: _build(src, dst, specs, options))


def _normalise_tensors(tensors: Any) -> NamedSpecs:
    if not isinstance(tensors, Mapping):
        raise UsageError("expected a mapping name -> (shape, dtype)", argument="tensors", value=type(tensors))
    out = []
    for name, spec in tensors.items():
        if not isinstance(name, str) or not name:
            raise UsageError("tensor names must be non-empty strings", argument="tensors", name=name)
        if not isinstance(spec, TensorSpec):
            if not isinstance(spec, (tuple, list)) or len(spec) != 2:
                raise UsageError("expected a TensorSpec or (shape, dtype)", argument="tensors", name=name)
            spec = TensorSpec(tuple(spec[0]) if hasattr(spec[0], "__iter__") else spec[0], spec[1])
        out.append((name, spec))
    return tuple(sorted(out, key=lambda item: item[0]))


def _normalise_layout(layout: Any, specs: NamedSpecs, argument: str) -> NamedShardings:
    out = []
    for name, spec in specs:
        if isinstance(layout, Sharding):
            sharding = layout
        elif isinstance(layout, Mapping):
            if name not in layout:
                raise UsageError(f"no sharding for tensor {name!r}", argument=argument)
            sharding = layout[name]
        else:
            raise UsageError("expected a Sharding or a mapping name -> Sharding", argument=argument)
        if not isinstance(sharding, Sharding):
            raise UsageError(f"sharding of {name!r} is not a Sharding", argument=argument, value=sharding)
        if len(sharding.spec) > len(spec.shape):
            raise UsageError(
                f"spec of {name!r} has {len(sharding.spec)} entries for a {len(spec.shape)}-D tensor",
                argument=argument,
                spec=sharding.spec,
            )
        out.append((name, sharding))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class _Work:
    """One chunk to deliver: a region, its candidate pushers and its receivers."""

    tensor: str
    spec: TensorSpec
    region: Box
    src_origin: Box
    dst_origin: Box
    candidates: tuple[int, ...]
    receivers: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.region.size * self.spec.itemsize


def _build(src: NamedShardings, dst: NamedShardings, specs: NamedSpecs, options: PlanOptions) -> TransferPlan:
    works: list[_Work] = []
    for (name, spec), (_, s_shard), (_, d_shard) in zip(specs, src, dst):
        for work in _chunks(name, spec, s_shard, d_shard):
            works.extend(_segments(work, options.segment_bytes))
    transfers = _assign(works, options.fanout)
    transfers.sort(key=lambda t: (t.stage, t.dst_rank, t.tensor, t.global_box.start))
    return TransferPlan(dict(specs), dict(src), dict(dst), options, tuple(transfers))


def _overlaps(size: int, n_src: int, n_dst: int) -> list[tuple[int, int, int, int]]:
    """``(src_index, dst_index, lo, hi)`` for every non-empty overlap along one dimension."""
    out = []
    dst_iv = dim_intervals(size, n_dst)
    for i, (a_lo, a_hi) in enumerate(dim_intervals(size, n_src)):
        for j, (b_lo, b_hi) in enumerate(dst_iv):
            lo, hi = max(a_lo, b_lo), min(a_hi, b_hi)
            if lo < hi:
                out.append((i, j, lo, hi))
    return out


def _chunks(name: str, spec: TensorSpec, src: Sharding, dst: Sharding) -> Iterator[_Work]:
    """Every non-empty intersection of a source shard with a destination shard."""
    shape = spec.shape
    s_counts, d_counts = src.shard_counts(len(shape)), dst.shard_counts(len(shape))
    s_groups, d_groups = replica_groups(shape, src), replica_groups(shape, dst)
    s_iv = [dim_intervals(g, n) for g, n in zip(shape, s_counts)]
    d_iv = [dim_intervals(g, n) for g, n in zip(shape, d_counts)]
    per_dim = [_overlaps(g, ns, nd) for g, ns, nd in zip(shape, s_counts, d_counts)]
    for combo in itertools.product(*per_dim):
        s_idx = tuple(c[0] for c in combo)
        d_idx = tuple(c[1] for c in combo)
        yield _Work(
            tensor=name,
            spec=spec,
            region=Box(tuple(c[2] for c in combo), tuple(c[3] for c in combo)),
            src_origin=_box_of(s_iv, s_idx),
            dst_origin=_box_of(d_iv, d_idx),
            candidates=s_groups[s_idx],
            receivers=d_groups[d_idx],
        )


def _box_of(intervals: list[tuple[tuple[int, int], ...]], idx: tuple[int, ...]) -> Box:
    parts = [intervals[d][i] for d, i in enumerate(idx)]
    return Box(tuple(p[0] for p in parts), tuple(p[1] for p in parts))


def _segments(work: _Work, segment_bytes: int | None) -> list[_Work]:
    """Cut ``work`` along its outermost non-trivial dimension into pieces of at most
    ``segment_bytes`` (a slice of that dimension larger than that is cut along the next one;
    only a single element may exceed it)."""
    if segment_bytes is None or work.nbytes <= segment_bytes:
        return [work]
    extents = work.region.shape
    d = next((i for i, e in enumerate(extents) if e > 1), None)
    if d is None:
        return [work]
    unit = work.nbytes // extents[d]
    step = max(1, segment_bytes // unit)
    out = []
    for lo in range(work.region.start[d], work.region.stop[d], step):
        hi = min(lo + step, work.region.stop[d])
        start = work.region.start[:d] + (lo,) + work.region.start[d + 1 :]
        stop = work.region.stop[:d] + (hi,) + work.region.stop[d + 1 :]
        piece = _replace_region(work, Box(start, stop))
        out.extend(_segments(piece, segment_bytes) if unit > segment_bytes else [piece])
    return out


def _replace_region(work: _Work, region: Box) -> _Work:
    return _Work(work.tensor, work.spec, region, work.src_origin, work.dst_origin, work.candidates, work.receivers)


def _assign(works: list[_Work], fanout: int) -> list[Transfer]:
    """Pick pushers (least loaded first) and build relay trees; returns unsorted transfers."""
    loads: dict[int, int] = {}
    out: list[Transfer] = []
    order = sorted(works, key=lambda w: (-w.nbytes, w.tensor, w.region.start, w.receivers))
    for n, work in enumerate(order):
        receivers = work.receivers
        if len(receivers) > fanout:
            shift = n % len(receivers)
            receivers = receivers[shift:] + receivers[:shift]
        itemsize = work.spec.itemsize
        src_box = work.region.relative_to(work.src_origin)
        dst_box = work.region.relative_to(work.dst_origin)
        src_span = box_span(work.src_origin.shape, src_box, itemsize)
        dst_span = box_span(work.dst_origin.shape, dst_box, itemsize)
        stage_of: list[int] = []
        for j, rank in enumerate(receivers):
            if j < fanout:
                sender = min(work.candidates, key=lambda c: (loads.get(c, 0), c))
                loads[sender] = loads.get(sender, 0) + work.nbytes
                kind, box, span, stage = TransferKind.PUSH, src_box, src_span, 0
            else:
                parent = (j - fanout) // fanout
                sender, stage = receivers[parent], stage_of[parent] + 1
                kind, box, span = TransferKind.RELAY, dst_box, dst_span
            stage_of.append(stage)
            out.append(Transfer(work.tensor, kind, sender, rank, work.region, box, dst_box, span, dst_span, stage))
    return out
