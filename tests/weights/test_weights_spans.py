"""Byte spans of boxes inside C-contiguous buffers."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiersync.errors import UsageError
from tiersync.weights import Box, StridedSpan, box_span, span_view


def test_full_buffer_is_one_run():
    span = box_span((3, 4, 5), Box((0, 0, 0), (3, 4, 5)), 2)
    assert span == StridedSpan(0, 120, (), ())
    assert span.is_contiguous and span.row_stride == 120 and span.row_count == 1


def test_column_block_is_evenly_strided_rows():
    span = box_span((4, 10), Box((1, 2), (3, 5)), 4)
    assert span == StridedSpan(offset=48, row_bytes=12, counts=(2,), strides=(40,))
    assert span.row_stride == 40 and span.row_count == 2 and span.nbytes == 24
    assert list(span.rows()) == [(48, 12), (88, 12)]


def test_full_inner_rows_merge_into_one_run():
    span = box_span((4, 3, 5), Box((1, 0, 0), (3, 3, 5)), 1)
    assert span == StridedSpan(15, 30, (), ())


def test_outer_dims_merge_when_regular():
    # partial last dim, full middle dim: outer dims (2, 3) merge into 6 rows of stride 5
    span = box_span((4, 3, 5), Box((1, 0, 1), (3, 3, 4)), 1)
    assert span == StridedSpan(16, 3, (6,), (5,))


def test_irregular_outer_dims_stay_nd():
    span = box_span((4, 3, 5), Box((0, 0, 0), (2, 2, 2)), 1)
    assert span == StridedSpan(0, 2, (2, 2), (15, 5))
    assert span.row_stride is None


@pytest.mark.parametrize("box", [Box((0,), (0,)), Box((0,), (5,)), Box((0, 0), (1, 1))])
def test_bad_boxes(box):
    with pytest.raises(UsageError) as info:
        box_span((4,), box, 1)
    assert info.value.argument == "box"


@st.composite
def shape_and_box(draw):
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=0, max_size=4)))
    start, stop = [], []
    for size in shape:
        a = draw(st.integers(0, size - 1))
        start.append(a)
        stop.append(draw(st.integers(a + 1, size)))
    return shape, Box(tuple(start), tuple(stop)), draw(st.sampled_from([1, 2, 4, 8]))


@settings(max_examples=150, deadline=None)
@given(shape_and_box())
def test_span_lists_exactly_the_box_bytes_in_c_order(case):
    shape, box, itemsize = case
    nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
    ids = np.arange(nbytes, dtype=np.int64).reshape(shape + (itemsize,))
    expected = ids[box.slices()].reshape(-1)
    span = box_span(shape, box, itemsize)
    rows = np.concatenate([np.arange(o, o + n) for o, n in span.rows()])
    assert np.array_equal(rows, expected)
    assert span.nbytes == expected.size and span.extent <= nbytes
    assert span.disjoint and np.unique(rows).size == rows.size  # a box's rows never overlap
    buf = np.arange(nbytes, dtype=np.int64).astype(np.uint8)
    assert np.array_equal(span_view(buf, span).reshape(-1), expected.astype(np.uint8))


def test_span_view_rejects_overrun_and_non_contiguous():
    with pytest.raises(UsageError) as info:
        span_view(np.zeros(4, np.uint8), StridedSpan(2, 4))
    assert info.value.argument == "span"
    with pytest.raises(UsageError) as info:
        span_view(np.zeros((4, 4), np.uint8)[:, :2], StridedSpan(0, 1))
    assert info.value.argument == "buffer"


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 6),
    st.lists(st.tuples(st.integers(1, 4), st.integers(0, 24)), min_size=0, max_size=3),
)
def test_a_disjoint_span_lists_no_byte_twice(row_bytes, dims):
    """The W_GET / W_SUMS bound: a span whose rows share bytes (a stride of 0, rows closer than
    their length) is refused, so a few bytes of a tensor cannot be asked for 2**26 times."""
    span = StridedSpan(0, row_bytes, tuple(c for c, _ in dims), tuple(s for _, s in dims))
    rows = [o + i for o, n in span.rows() for i in range(n)]
    if span.disjoint:
        assert len(set(rows)) == len(rows), span
    if any(c > 1 and s == 0 for c, s in dims) or len(set(rows)) < len(rows):
        assert not span.disjoint, span


def test_a_get_or_sums_of_overlapping_rows_is_refused():
    from tiersync.weights.ops import Get, Sums

    flood = StridedSpan(0, 1, (1 << 26,), (0,))  # one byte, 2**26 times
    with pytest.raises(UsageError, match="overlap"):
        Get(1, 1, "w", (0,), flood)
    with pytest.raises(UsageError, match="overlap"):
        Sums(1, 1, "w", (flood,))
