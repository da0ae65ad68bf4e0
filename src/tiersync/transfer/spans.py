"""Block runs -> validated, coalesced byte spans.

A *run* is ``(src_block, dst_block, count)``: copy ``count`` consecutive blocks.
:func:`validate_runs` checks a whole request before anything moves (all or
nothing); :func:`pool_spans` turns runs into the byte spans of one pool on the
device side and its segment of the block-major host image, merging spans that
are adjacent on both sides. What the engine hands its kernel is smaller:
:func:`pool_pattern` (a pool's regions within one block, on both sides, computed once)
and :func:`block_copy` (one offset per block and side), so a pool whose blocks hold
a thousand small regions costs no Python or numpy work per region.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from tiersync.errors import UsageError
from tiersync.layout.pool import PoolSpec


@dataclass(frozen=True, slots=True)
class Spans:
    """Parallel int64 arrays: source offsets, destination offsets, lengths."""

    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", int(self.length.sum()))

    def __len__(self) -> int:
        return len(self.length)

    def split(self, max_bytes: int) -> list[Spans]:
        """Cut into consecutive pieces of at most ~``max_bytes`` (a span is never split)."""
        if len(self) == 0:
            return []
        csum = np.cumsum(self.length)
        cuts = np.searchsorted(csum, np.arange(max_bytes, int(csum[-1]), max_bytes), side="left") + 1
        edges = [0, *sorted({int(c) for c in cuts if 0 < c < len(self)}), len(self)]
        return [Spans(self.src[a:b], self.dst[a:b], self.length[a:b]) for a, b in itertools.pairwise(edges) if b > a]


def validate_runs(
    runs: Iterable[Sequence[int]], *, src_blocks: int, dst_blocks: int, argument: str = "runs"
) -> np.ndarray:
    """Return runs as an (n, 3) int64 array, or raise :class:`UsageError`.

    Refuses: a malformed run, a count <= 0, an index out of range on either side,
    and a block named twice on either side (overlapping runs).
    """
    try:
        if isinstance(runs, np.ndarray) and runs.dtype.kind in "iu":  # already an int array: as is
            raw = runs
        else:
            raw = np.array([tuple(r) for r in runs])
    except (TypeError, ValueError, OverflowError) as exc:
        raise UsageError("each run must be (src_block, dst_block, count) of ints", argument=argument) from exc
    if raw.size == 0:
        raise UsageError("no runs given", argument=argument)
    if raw.dtype.kind not in "iu" or (raw.dtype.kind == "u" and raw.max() > np.iinfo(np.int64).max):
        # floats would be truncated and strings parsed by a plain int64 cast
        raise UsageError(
            "each run must be (src_block, dst_block, count) of ints", argument=argument, dtype=str(raw.dtype)
        )
    arr = raw.astype(np.int64)
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise UsageError("each run must be (src_block, dst_block, count)", argument=argument)
    src, dst, cnt = arr[:, 0], arr[:, 1], arr[:, 2]
    if (cnt <= 0).any():
        i = int(np.argmax(cnt <= 0))
        raise UsageError("count must be positive", argument=f"{argument}[{i}]", count=int(cnt[i]))
    for name, start, limit in (("source", src, src_blocks), ("destination", dst, dst_blocks)):
        bad = (start < 0) | (start > limit) | (cnt > limit - start)  # no int64 overflow of start + cnt
        if bad.any():
            i = int(np.argmax(bad))
            raise UsageError(
                f"{name} blocks out of range",
                argument=f"{argument}[{i}]",
                first=int(start[i]),
                count=int(cnt[i]),
                num_blocks=limit,
            )
        twice = _named_twice(expand(start, cnt))
        if twice is not None:
            raise UsageError(f"{name} block named twice", argument=argument, block=twice)
    return arr


def _named_twice(ids: np.ndarray) -> int | None:
    """The smallest id that ``ids`` holds more than once, or None."""
    ordered = np.sort(ids)
    same = ordered[1:] == ordered[:-1]
    return int(ordered[1:][same][0]) if same.any() else None


def expand(start: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Block ids of runs: ``[s, s+1, ..., s+c-1]`` for each (s, c), concatenated; a new int64
    array. Counts must be positive (:func:`validate_runs` checked them)."""
    total = int(count.sum())
    if total == len(count):  # every count 1 (counts are positive): the starts themselves
        return start.astype(np.int64)
    offs = np.repeat(start - np.concatenate(([0], np.cumsum(count)[:-1])), count)
    return offs + np.arange(total, dtype=np.int64)


def pool_spans(spec: PoolSpec, host_offset: int, host_stride: int, runs: np.ndarray, *, to_host: bool) -> Spans:
    """Spans of one pool for ``runs``. ``to_host``: runs are (device, host, n), else (host, device, n)."""
    runs = runs[np.argsort(runs[:, 0], kind="stable")]  # source-ordered runs give sorted spans: no span sort
    dev_first, host_first = (runs[:, 0], runs[:, 1]) if to_host else (runs[:, 1], runs[:, 0])
    dev_ids = expand(dev_first, runs[:, 2])
    host_ids = expand(host_first, runs[:, 2])
    r_off = np.array([r.offset for r in spec.regions], dtype=np.int64)
    r_len = np.array([r.nbytes for r in spec.regions], dtype=np.int64)
    r_host = np.concatenate(([0], np.cumsum(r_len)[:-1]))
    dev = (spec.base_offset + dev_ids[:, None] * spec.block_stride + r_off[None, :]).ravel()
    host = (host_offset + host_ids[:, None] * host_stride + r_host[None, :]).ravel()
    length = np.broadcast_to(r_len, (len(dev_ids), len(r_len))).ravel()
    src, dst = (dev, host) if to_host else (host, dev)
    return coalesce(Spans(src, dst, np.ascontiguousarray(length)))


def coalesce(spans: Spans) -> Spans:
    """Merge spans adjacent in both source and destination (order by source first)."""
    if len(spans) <= 1:
        return spans
    if (spans.src[1:] >= spans.src[:-1]).all():
        s, d, n = spans.src, spans.dst, spans.length
    else:
        order = np.argsort(spans.src, kind="stable")
        s, d, n = spans.src[order], spans.dst[order], spans.length[order]
    joins = (s[:-1] + n[:-1] == s[1:]) & (d[:-1] + n[:-1] == d[1:])
    if not joins.any():
        return Spans(s, d, n)
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    lengths = np.add.reduceat(n, starts)
    return Spans(np.ascontiguousarray(s[starts]), np.ascontiguousarray(d[starts]), lengths.astype(np.int64))


@dataclass(frozen=True, slots=True)
class Pattern:
    """One pool's bytes within a block: region offsets on the source and destination side
    and their lengths (parallel int64 arrays, regions adjacent on both sides merged)."""

    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray
    block_nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        _check_int64(self.src, self.dst, self.length)
        object.__setattr__(self, "block_nbytes", int(self.length.sum()))


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Blocks to copy with one :class:`Pattern`: ``src[i]`` / ``dst[i]`` are block ``i``'s
    byte offsets on each side (int64 arrays), ordered by source."""

    src: np.ndarray
    dst: np.ndarray
    pattern: Pattern
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, Pattern):
            raise UsageError("must be a Pattern", argument="spans")
        _check_int64(self.src, self.dst)
        object.__setattr__(self, "nbytes", len(self.src) * self.pattern.block_nbytes)

    def __len__(self) -> int:
        return len(self.src)

    def split(self, max_bytes: int) -> list[BlockCopy]:
        """Consecutive pieces of at most ``max_bytes`` each (a block is never split)."""
        per = max(1, max_bytes // max(self.pattern.block_nbytes, 1))
        return [BlockCopy(self.src[i : i + per], self.dst[i : i + per], self.pattern) for i in range(0, len(self), per)]


def _check_int64(*arrays: np.ndarray) -> None:
    """The arrays a copy backend reads: 1-d C-contiguous int64 of one length (UsageError naming
    ``spans`` otherwise), so a BlockCopy is valid by construction."""
    n = len(arrays[0]) if isinstance(arrays[0], np.ndarray) else -1
    for a in arrays:
        if not isinstance(a, np.ndarray) or a.dtype != np.int64 or a.ndim != 1 or not a.flags.c_contiguous:
            raise UsageError("block and region arrays must be 1-d C-contiguous int64", argument="spans")
        if len(a) != n:
            raise UsageError("block arrays, and region arrays, must be equal in length", argument="spans")


def pool_pattern(spec: PoolSpec, *, to_host: bool) -> Pattern:
    """``spec``'s regions in a device block and in its segment of a host block."""
    dev = np.array([r.offset for r in spec.regions], dtype=np.int64)
    length = np.array([r.nbytes for r in spec.regions], dtype=np.int64)
    host = np.concatenate(([0], np.cumsum(length)[:-1])).astype(np.int64)
    merged = coalesce(Spans(dev, host, length) if to_host else Spans(host, dev, length))
    return Pattern(merged.src, merged.dst, merged.length)


def block_copy(pattern: Pattern, block_stride: int, host_stride: int, runs: np.ndarray, *, to_host: bool) -> BlockCopy:
    """The block offsets of ``runs`` (validated) for a pool of ``block_stride`` with host
    blocks of ``host_stride``. ``to_host``: runs are (device, host, n), else (host, device, n)."""
    runs = runs[np.argsort(runs[:, 0], kind="stable")]
    src_ids, dst_ids = expand(runs[:, 0], runs[:, 2]), expand(runs[:, 1], runs[:, 2])
    src_stride, dst_stride = (block_stride, host_stride) if to_host else (host_stride, block_stride)
    return BlockCopy(src_ids * src_stride, dst_ids * dst_stride, pattern)
