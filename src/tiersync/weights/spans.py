"""Byte-level descriptions of an N-D box inside a C-contiguous buffer.

A :class:`StridedSpan` is what a transport needs to move a chunk without knowing about
tensors: a start offset, the length of one contiguous row, and the outer dimensions
(counts and byte strides, major first) over which rows repeat. Dimensions are merged as
far as the layout allows, so a box that is one contiguous run has no outer dimensions
and a box of evenly spaced rows has exactly one (``row_stride``/``row_count``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from tiersync.errors import UsageError
from tiersync.weights.sharding import Box

__all__ = ["StridedSpan", "box_span"]


@dataclass(frozen=True, slots=True)
class StridedSpan:
    """Bytes ``offset + sum(i[k] * strides[k]) + [0, row_bytes)`` for every ``i < counts``.

    Rows are enumerated in C order of ``counts``; that order is the C order of the box's
    elements, so a source span and a destination span of the same box list the same bytes
    in the same order even when their shapes differ.
    """

    offset: int
    row_bytes: int
    counts: tuple[int, ...] = ()
    strides: tuple[int, ...] = ()

    @property
    def row_count(self) -> int:
        """Number of contiguous rows."""
        return math.prod(self.counts)

    @property
    def nbytes(self) -> int:
        """Total bytes described."""
        return self.row_bytes * self.row_count

    @property
    def row_stride(self) -> int | None:
        """Byte distance between consecutive rows when rows are evenly spaced, else ``None``.

        A single contiguous run reports ``row_bytes`` (its one row, trivially spaced).
        """
        if not self.counts:
            return self.row_bytes
        if len(self.counts) == 1:
            return self.strides[0]
        return None

    @property
    def disjoint(self) -> bool:
        """True when each dimension's stride, in order of size, reaches past everything the
        smaller ones cover: then no two rows share a byte. Every span of a tensor's box is so;
        a span whose rows interleave is not, even where they share no byte."""
        extent = self.row_bytes
        for stride, count in sorted((st, c) for c, st in zip(self.counts, self.strides) if c > 1):
            if stride < extent:
                return False
            extent = (count - 1) * stride + extent
        return True

    @property
    def is_contiguous(self) -> bool:
        """True when the span is one run of ``nbytes`` bytes."""
        return not self.counts

    def rows(self) -> Iterator[tuple[int, int]]:
        """Yield ``(offset, length)`` of every contiguous row, in order."""
        if not self.counts:
            yield self.offset, self.row_bytes
            return
        for flat in range(self.row_count):
            off, rest = self.offset, flat
            for count, stride in zip(reversed(self.counts), reversed(self.strides)):
                rest, i = divmod(rest, count)
                off += i * stride
            yield off, self.row_bytes

    @property
    def extent(self) -> int:
        """One past the last byte touched, relative to the buffer start."""
        last = sum((c - 1) * s for c, s in zip(self.counts, self.strides))
        return self.offset + last + self.row_bytes


def box_span(local_shape: Sequence[int], box: Box, itemsize: int) -> StridedSpan:
    """The bytes of ``box`` inside a C-contiguous array of ``local_shape`` and ``itemsize``.

    ``box`` must be non-empty and lie inside ``local_shape``; :class:`UsageError` otherwise.
    """
    shape = tuple(local_shape)
    if len(box.start) != len(shape):
        raise UsageError("box rank differs from shape rank", argument="box", box=box, shape=shape)
    if any(a < 0 or b > s or b <= a for a, b, s in zip(box.start, box.stop, shape)):
        raise UsageError("box must be non-empty and inside the shape", argument="box", box=box, shape=shape)
    strides = _c_strides(shape, itemsize)
    offset = sum(a * s for a, s in zip(box.start, strides))
    extents = box.shape
    d = len(shape)
    row = itemsize
    # Merge inner dimensions into the row while the row exactly covers the inner stride.
    while d > 0 and (strides[d - 1] == row):
        d -= 1
        row *= extents[d]
        if extents[d] != shape[d]:
            break
    outer = [(c, s) for c, s in zip(extents[:d], strides[:d]) if c != 1]
    merged: list[tuple[int, int]] = []
    for count, stride in reversed(outer):
        if merged and stride == merged[-1][0] * merged[-1][1]:
            inner_count, inner_stride = merged.pop()
            merged.append((count * inner_count, inner_stride))
        else:
            merged.append((count, stride))
    merged.reverse()
    return StridedSpan(offset, row, tuple(c for c, _ in merged), tuple(s for _, s in merged))


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    out, acc = [], itemsize
    for size in reversed(shape):
        out.append(acc)
        acc *= size
    return tuple(reversed(out))
