"""KV resharding planner: move one request's KV from a prefill layout to a decode layout.

Source and destination may differ in tensor-parallel degree (heads split differently; with
fewer heads than ranks, heads are replicated and one replica is picked per destination rank,
balanced: the k-th destination rank needing a head reads it from replica ``k % replicas``),
in block size (a destination block then gathers from several source blocks: token ``t`` is at
slot ``t % block_size`` of block ``block_ids[t // block_size]`` on each side) and in
:class:`~tiersync.disagg.geometry.KVOrder`. Layer count, global head count, head_dim and dtype
must match.

A plan is a set of byte spans ``(src_rank, src_offset, dst_rank, dst_offset, nbytes)`` with
offsets into *one layer's* tensor (identical for every layer), coalesced where contiguous on
both sides, sorted by (dst_rank, src_rank, src_offset). Routes (which source rank feeds which
heads of which destination rank) depend only on the two layouts and are cached per
``(src, dst)`` in a :class:`ReshardPlanner`; the per-request spans are computed with numpy.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import numpy as np

from tiersync.disagg.geometry import KVOrder, PagedKVLayout
from tiersync.errors import UsageError, check_positive_int

__all__ = [
    "ReshardPlan",
    "ReshardPlanner",
    "Route",
    "Transfer",
    "block_table",
    "check_compatible",
    "default_planner",
    "plan_reshard",
]

SRC_RANK, SRC_OFF, DST_RANK, DST_OFF, NBYTES = range(5)

_K = TypeVar("_K", bound=Hashable)
_V = TypeVar("_V")


class Route(NamedTuple):
    """Heads ``[src_head, src_head+nheads)`` local to ``src_rank`` land at local heads
    ``[dst_head, dst_head+nheads)`` of ``dst_rank``."""

    src_rank: int
    dst_rank: int
    src_head: int
    dst_head: int
    nheads: int


class Transfer(NamedTuple):
    """One byte span of one layer: offsets are bytes into that layer's tensor on each rank."""

    src_rank: int
    layer: int
    src_offset: int
    dst_rank: int
    dst_offset: int
    nbytes: int


def check_compatible(src: PagedKVLayout, dst: PagedKVLayout) -> None:
    """Raise :class:`UsageError` (argument ``dst.<field>``) unless ``dst`` can receive ``src``'s KV."""
    if not isinstance(src, PagedKVLayout):
        raise UsageError("must be a PagedKVLayout", argument="src", got=type(src).__name__)
    if not isinstance(dst, PagedKVLayout):
        raise UsageError("must be a PagedKVLayout", argument="dst", got=type(dst).__name__)
    for name in ("num_layers", "num_kv_heads", "head_dim", "dtype"):
        a, b = getattr(src, name), getattr(dst, name)
        if a != b:
            raise UsageError("differs between source and destination", argument=f"dst.{name}", src=a, dst=b)


def build_routes(src: PagedKVLayout, dst: PagedKVLayout) -> tuple[Route, ...]:
    """Which source rank feeds which local heads of every destination rank (see module doc)."""
    check_compatible(src, dst)
    holders: dict[int, list[int]] = {}
    for r in range(src.tp_size):
        first, count = src.heads_of(r)
        for h in range(first, first + count):
            holders.setdefault(h, []).append(r)
    seen: dict[int, int] = {}  # global head -> destination ranks that already asked for it
    routes: list[Route] = []
    for d in range(dst.tp_size):
        first, count = dst.heads_of(d)
        for j in range(count):
            h = first + j
            k = seen.get(h, 0)
            seen[h] = k + 1
            s = holders[h][k % len(holders[h])]
            src_local = h - src.heads_of(s)[0]
            last = routes[-1] if routes else None
            if (
                last is not None
                and last.dst_rank == d
                and last.src_rank == s
                and last.src_head + last.nheads == src_local
                and last.dst_head + last.nheads == j
            ):
                routes[-1] = last._replace(nheads=last.nheads + 1)
            else:
                routes.append(Route(s, d, src_local, j, 1))
    return tuple(routes)


def block_table(ids: object, layout: PagedKVLayout, num_tokens: int, argument: str) -> np.ndarray:
    """The first ``ceil(num_tokens / block_size)`` ids as int64, validated (1-D integers, long
    enough, in ``[0, num_blocks)``). Raises UsageError naming ``argument``."""
    try:
        arr = np.asarray(ids)
    except Exception:  # noqa: BLE001 - any unconvertible input is the caller's error
        raise UsageError("must be a sequence of block ids", argument=argument) from None
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise UsageError("must be a 1-D sequence of integer block ids", argument=argument)
    need = layout.blocks_needed(num_tokens)
    if arr.size < need:
        raise UsageError(
            "too short for the token count",
            argument=argument,
            blocks=int(arr.size),
            needed=need,
            num_tokens=num_tokens,
            block_size=layout.block_size,
        )
    arr = arr[:need].astype(np.int64)
    if arr.min() < 0 or arr.max() >= layout.num_blocks:
        raise UsageError("block id out of range", argument=argument, num_blocks=layout.num_blocks)
    return arr


def _slot_offsets(layout: PagedKVLayout, table: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Where token ``t``'s slot starts (K, head 0 terms aside): its block's and its slot's offset."""
    out: np.ndarray = (
        table[t // layout.block_size] * layout.block_stride() + (t % layout.block_size) * layout.token_stride()
    )
    return out


def _runs(src: PagedKVLayout, dst: PagedKVLayout, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(first token, length) of the runs of tokens in one block on each side: cut wherever
    either side's blocks end."""
    cuts = np.concatenate([np.arange(0, num_tokens, src.block_size), np.arange(0, num_tokens, dst.block_size)])
    cuts.sort()
    starts = cuts[np.r_[True, cuts[1:] != cuts[:-1]]]
    return starts, np.diff(np.append(starts, num_tokens))


def _pieces(route: Route, src: PagedKVLayout, dst: PagedKVLayout) -> list[tuple[int, int, int]]:
    """(source offset, destination offset, bytes) of each piece of one token the route moves:
    a head's K and V together when both sides are head-major (they are back to back there);
    else K and V apart, all the route's heads in one piece when they are contiguous on both
    sides, else one piece per head."""
    hn = src.head_nbytes
    kvs: tuple[int, ...] = (0, 1)  # K and V apart
    if src.order is KVOrder.HEAD_MAJOR and dst.order is KVOrder.HEAD_MAJOR:
        heads, kvs, width = range(route.nheads), (0,), 2 * hn  # K, and V with it
    elif src.head_stride() == hn and dst.head_stride() == hn:
        heads, width = range(1), route.nheads * hn
    else:
        heads, width = range(route.nheads), hn
    return [
        (
            src.kv_base(kv) + (route.src_head + j) * src.head_stride(),
            dst.kv_base(kv) + (route.dst_head + j) * dst.head_stride(),
            width,
        )
        for kv in kvs
        for j in heads
    ]


def coalesce(src_off: np.ndarray, dst_off: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """Merge spans (sorted by source offset here) adjacent on both sides; returns (n, 3) int64
    ``[src_off, dst_off, nbytes]``."""
    order = np.argsort(src_off)  # no two spans of a route start at one source byte
    s, d, n = src_off[order], dst_off[order], nbytes[order]
    if s.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    brk = np.ones(s.size, dtype=bool)
    brk[1:] = (s[1:] != s[:-1] + n[:-1]) | (d[1:] != d[:-1] + n[:-1])
    starts = np.flatnonzero(brk)
    ends = np.append(starts[1:], s.size)
    total = np.cumsum(n)
    run_bytes = total[ends - 1] - np.where(starts > 0, total[starts - 1], 0)
    return np.stack([s[starts], d[starts], run_bytes], axis=1)


def _route_spans(
    route: Route, src: PagedKVLayout, dst: PagedKVLayout, src_table: np.ndarray, dst_table: np.ndarray, num_tokens: int
) -> np.ndarray:
    """The route's spans, coalesced. A piece whose tokens follow each other on both sides (its
    width is the token stride of both) is taken a run of tokens at a time, else a token at a
    time: the same spans either way once coalesced, from far fewer rows (a 6000-token
    head-major request: 3000 rows instead of 96000)."""
    starts, lens = _runs(src, dst, num_tokens)
    tokens = np.arange(num_tokens, dtype=np.int64)
    parts_s, parts_d, parts_n = [], [], []
    for s_off, d_off, width in _pieces(route, src, dst):
        by_run = src.token_stride() == width == dst.token_stride()
        t = starts if by_run else tokens
        parts_s.append(_slot_offsets(src, src_table, t) + s_off)
        parts_d.append(_slot_offsets(dst, dst_table, t) + d_off)
        parts_n.append(lens * width if by_run else np.full(num_tokens, width, np.int64))
    spans = coalesce(np.concatenate(parts_s), np.concatenate(parts_d), np.concatenate(parts_n))
    ranks = np.empty((spans.shape[0], 5), dtype=np.int64)
    ranks[:, SRC_RANK], ranks[:, DST_RANK] = route.src_rank, route.dst_rank
    ranks[:, SRC_OFF], ranks[:, DST_OFF], ranks[:, NBYTES] = spans[:, 0], spans[:, 1], spans[:, 2]
    return ranks


@dataclass(frozen=True, slots=True, eq=False)
class ReshardPlan:
    """The spans moving one request (``num_tokens`` tokens) from ``src`` to ``dst``, per layer.

    ``spans``: read-only int64 array ``(n, 5)`` of columns
    ``src_rank, src_offset, dst_rank, dst_offset, nbytes`` (see module doc). Every destination
    byte of the request's tokens is written by exactly one span.
    """

    src: PagedKVLayout
    dst: PagedKVLayout
    num_tokens: int
    routes: tuple[Route, ...]
    spans: np.ndarray

    @property
    def num_layers(self) -> int:
        return self.src.num_layers

    def route_spans(self, src_rank: int, dst_rank: int) -> np.ndarray:
        """``(n, 3)`` int64 ``[src_offset, dst_offset, nbytes]`` that ``src_rank`` sends ``dst_rank``
        per layer (possibly empty), in the order a transport sends them."""
        sel = (self.spans[:, SRC_RANK] == src_rank) & (self.spans[:, DST_RANK] == dst_rank)
        rows: np.ndarray = self.spans[sel][:, [SRC_OFF, DST_OFF, NBYTES]]
        return rows

    def route_nbytes(self, src_rank: int, dst_rank: int) -> int:
        """Bytes per layer that ``src_rank`` sends to ``dst_rank``."""
        return int(self.route_spans(src_rank, dst_rank)[:, 2].sum())

    def sources_of(self, dst_rank: int) -> tuple[int, ...]:
        """Source ranks that feed ``dst_rank`` (sorted)."""
        return tuple(sorted({r.src_rank for r in self.routes if r.dst_rank == dst_rank}))

    def readers_of(self, src_rank: int) -> tuple[int, ...]:
        """Destination ranks that read from ``src_rank`` (sorted; empty for an unused replica)."""
        return tuple(sorted({r.dst_rank for r in self.routes if r.src_rank == src_rank}))

    def idle_sources(self) -> tuple[int, ...]:
        """Source ranks no destination rank reads from (replicas not picked)."""
        used = {r.src_rank for r in self.routes}
        return tuple(r for r in range(self.src.tp_size) if r not in used)

    def transfers(self, layer: int | None = None) -> Iterator[Transfer]:
        """Every span as a :class:`Transfer`, for ``layer`` or (None) for every layer in order."""
        layers = range(self.num_layers) if layer is None else (layer,)
        for each in layers:
            for row in self.spans.tolist():
                yield Transfer(row[SRC_RANK], each, row[SRC_OFF], row[DST_RANK], row[DST_OFF], row[NBYTES])


def _build_plan(
    src: PagedKVLayout, dst: PagedKVLayout, routes: tuple[Route, ...], src_ids: object, dst_ids: object, num_tokens: int
) -> ReshardPlan:
    src_table = block_table(src_ids, src, num_tokens, "src_block_ids")
    dst_table = block_table(dst_ids, dst, num_tokens, "dst_block_ids")
    if len(set(dst_table.reshape(-1).tolist())) != dst_table.size:  # not np.unique: it imports numpy.ma
        raise UsageError("destination block ids must be distinct", argument="dst_block_ids")
    parts = [_route_spans(r, src, dst, src_table, dst_table, num_tokens) for r in routes]
    spans = np.concatenate(parts) if parts else np.zeros((0, 5), dtype=np.int64)
    spans = spans[np.lexsort((spans[:, SRC_OFF], spans[:, SRC_RANK], spans[:, DST_RANK]))]
    spans.setflags(write=False)
    return ReshardPlan(src, dst, num_tokens, routes, spans)


_PlanKey = tuple[PagedKVLayout, PagedKVLayout, tuple[tuple[int, ...], tuple[int, ...]], int]
"""A cached plan's key: the two layouts, the block ids each side uses, the token count."""


class ReshardPlanner:
    """Plans with two caches: routes per ``(src, dst)`` layout pair (``max_layouts``) and whole
    plans per ``(src, dst, block tables, num_tokens)`` (``max_plans``, so the producer and the
    consumer of one request, or several readers of one producer, plan once). Thread-safe."""

    def __init__(self, max_layouts: int = 64, max_plans: int = 256) -> None:
        check_positive_int(max_layouts, "max_layouts")
        check_positive_int(max_plans, "max_plans")
        self._routes: OrderedDict[tuple[PagedKVLayout, PagedKVLayout], tuple[Route, ...]] = OrderedDict()
        self._plans: OrderedDict[_PlanKey, ReshardPlan] = OrderedDict()
        self._limits = (max_layouts, max_plans)
        self._lock = threading.Lock()

    def routes(self, src: PagedKVLayout, dst: PagedKVLayout) -> tuple[Route, ...]:
        """Cached :func:`build_routes`."""
        check_compatible(src, dst)
        return self._cached(self._routes, (src, dst), self._limits[0], lambda: build_routes(src, dst))

    def plan(
        self,
        src: PagedKVLayout,
        dst: PagedKVLayout,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        num_tokens: int,
    ) -> ReshardPlan:
        """Plan one request. Only the first ``ceil(num_tokens / block_size)`` ids of each block
        table are used. Raises :class:`UsageError` naming ``src``/``dst``/``dst.<field>``,
        ``num_tokens``, ``src_block_ids`` or ``dst_block_ids`` (too short, out of range,
        duplicate destination ids)."""
        check_positive_int(num_tokens, "num_tokens")
        routes = self.routes(src, dst)
        src_ids, dst_ids = _ids_key(src_block_ids, src, num_tokens), _ids_key(dst_block_ids, dst, num_tokens)

        def build() -> ReshardPlan:
            return _build_plan(src, dst, routes, src_block_ids, dst_block_ids, num_tokens)

        if src_ids is None or dst_ids is None:
            return build()  # odd input: _build_plan raises the precise error
        return self._cached(self._plans, (src, dst, (src_ids, dst_ids), num_tokens), self._limits[1], build)

    def route(
        self,
        src: PagedKVLayout,
        dst: PagedKVLayout,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        num_tokens: int,
        ranks: tuple[int, int],
    ) -> tuple[np.ndarray, tuple[int, ...]]:
        """What source rank ``ranks[0]`` sends destination rank ``ranks[1]``: the rows
        :meth:`ReshardPlan.route_spans` gives, and the destination ranks that read from that
        source rank. Only that route is planned (not cached): a prefill rank asked by a reader
        pays for the reader's own route, whatever layout the reader names. Raises as
        :meth:`plan`."""
        check_positive_int(num_tokens, "num_tokens")
        routes = self.routes(src, dst)
        mine = tuple(r for r in routes if (r.src_rank, r.dst_rank) == ranks)
        plan = _build_plan(src, dst, mine, src_block_ids, dst_block_ids, num_tokens)
        return plan.route_spans(*ranks), tuple(sorted({r.dst_rank for r in routes if r.src_rank == ranks[0]}))

    def _cached(self, cache: OrderedDict[_K, _V], key: _K, limit: int, build: Callable[[], _V]) -> _V:
        with self._lock:
            if key in cache:
                cache.move_to_end(key)
                return cache[key]
        value = build()
        with self._lock:
            cache[key] = value
            while len(cache) > limit:
                cache.popitem(last=False)
        return value

    def __len__(self) -> int:
        with self._lock:
            return len(self._routes)


def _ids_key(ids: Sequence[int], layout: PagedKVLayout, num_tokens: int) -> tuple[int, ...] | None:
    try:
        return tuple(int(i) for i in list(ids)[: layout.blocks_needed(num_tokens)])
    except (TypeError, ValueError):
        return None


_DEFAULT = ReshardPlanner()


def default_planner() -> ReshardPlanner:
    """The process-wide planner :func:`plan_reshard` uses."""
    return _DEFAULT


def plan_reshard(
    src: PagedKVLayout, dst: PagedKVLayout, src_block_ids: Sequence[int], dst_block_ids: Sequence[int], num_tokens: int
) -> ReshardPlan:
    """:meth:`ReshardPlanner.plan` on the default planner."""
    return _DEFAULT.plan(src, dst, src_block_ids, dst_block_ids, num_tokens)


def route_digest(rows: np.ndarray) -> int:
    """A 64-bit digest of a route's ``[src_offset, dst_offset, nbytes]`` rows
    (:meth:`ReshardPlan.route_spans`, in order). Both ends of a read plan the route from the
    same KV_OPEN and compare digests (KV_OPENED): a reader and a producer that planned it
    differently (another tiersync version, a planner bug) never move bytes to places the
    other did not plan, even where their byte totals agree."""
    data = np.ascontiguousarray(rows, dtype="<i8").tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
