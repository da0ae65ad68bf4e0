"""Runs -> validated, coalesced byte spans (tiersync.transfer.spans)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiersync.errors import UsageError
from tiersync.layout.pool import PoolSpec, Region
from tiersync.transfer.spans import (
    BlockCopy,
    Spans,
    block_copy,
    coalesce,
    expand,
    pool_pattern,
    pool_spans,
    validate_runs,
)


def spans(rows) -> Spans:
    a = np.array(rows, dtype=np.int64).reshape(-1, 3)
    return Spans(a[:, 0].copy(), a[:, 1].copy(), a[:, 2].copy())


def byte_map(s: Spans) -> dict[int, int]:
    """Every source byte -> its destination byte."""
    out = {}
    for src, dst, n in zip(s.src.tolist(), s.dst.tolist(), s.length.tolist()):
        for i in range(n):
            assert src + i not in out
            out[src + i] = dst + i
    return out


# -- validate_runs -----------------------------------------------------------
def test_valid_runs_come_back_as_int64_array():
    arr = validate_runs([(0, 5, 2), [3, 0, 1], np.array([7, 2, 1])], src_blocks=8, dst_blocks=8)
    assert arr.dtype == np.int64 and arr.tolist() == [[0, 5, 2], [3, 0, 1], [7, 2, 1]]
    arr = validate_runs(np.array([[0, 0, 8]], dtype=np.uint32), src_blocks=8, dst_blocks=8)
    assert arr.dtype == np.int64 and arr.tolist() == [[0, 0, 8]]


def test_runs_may_end_exactly_at_the_last_block():
    assert validate_runs([(6, 0, 2)], src_blocks=8, dst_blocks=2).tolist() == [[6, 0, 2]]


@pytest.mark.parametrize(
    "runs, words",
    [
        ([], "no runs"),
        ([(0, 1)], "(src_block, dst_block, count)"),
        ([(0, 1, 2, 3)], "(src_block, dst_block, count)"),
        ([(0, 1, 1), (0, 1)], "(src_block, dst_block, count)"),
        ([5], "(src_block, dst_block, count)"),
        (None, "(src_block, dst_block, count)"),
        ([(1.5, 0, 1)], "ints"),
        ([(1.0, 0, 1)], "ints"),
        ([("1", 0, 1)], "ints"),
        ([(None, 0, 1)], "ints"),
        ([(True, False, True)], "ints"),
        ([(2**64, 0, 1)], "ints"),
    ],
    ids=[
        "empty",
        "short",
        "long",
        "ragged",
        "scalar",
        "none",
        "float",
        "float-int",
        "str",
        "none-item",
        "bool",
        "huge",
    ],
)
def test_malformed_runs_are_refused(runs, words):
    with pytest.raises(UsageError) as ei:
        validate_runs(runs, src_blocks=8, dst_blocks=8, argument="myruns")
    assert ei.value.argument == "myruns" and words in str(ei.value)


@pytest.mark.parametrize(
    "runs, arg, words",
    [
        ([(0, 0, 1), (1, 1, 0)], "r[1]", "count must be positive"),
        ([(0, 0, -2)], "r[0]", "count must be positive"),
        ([(-1, 0, 1)], "r[0]", "source blocks out of range"),
        ([(8, 0, 1)], "r[0]", "source blocks out of range"),
        ([(0, 0, 1), (6, 1, 3)], "r[1]", "source blocks out of range"),  # run overruns the end
        ([(0, -1, 1)], "r[0]", "destination blocks out of range"),
        ([(0, 3, 2)], "r[0]", "destination blocks out of range"),
        ([(2**63 - 1, 0, 1)], "r[0]", "source blocks out of range"),  # start + count overflows int64
        ([(0, 2**63 - 2, 2)], "r[0]", "destination blocks out of range"),
        ([(0, 0, 2**63 - 1)], "r[0]", "out of range"),
        ([(0, 0, 2), (1, 2, 1)], "r", "source block named twice"),
        ([(0, 0, 1), (0, 1, 1)], "r", "source block named twice"),
        ([(0, 1, 1), (1, 1, 1)], "r", "destination block named twice"),
        ([(0, 0, 2), (4, 1, 1)], "r", "destination block named twice"),
    ],
)
def test_bad_runs_are_refused_naming_the_run(runs, arg, words):
    with pytest.raises(UsageError) as ei:
        validate_runs(runs, src_blocks=8, dst_blocks=4, argument="r")
    assert ei.value.argument == arg and words in str(ei.value)


def test_expand():
    assert expand(np.array([5, 0, 9]), np.array([2, 3, 1])).tolist() == [5, 6, 0, 1, 2, 9]
    for starts in (np.array([7, 2, 4], dtype=np.int32), np.array([7, 2, 4], dtype=np.int64)):
        ids = expand(starts, np.ones(3, dtype=np.int64))  # runs of one block: the starts, as a new int64 array
        assert ids.tolist() == [7, 2, 4] and ids.dtype == np.int64 and not np.shares_memory(ids, starts)


def test_runs_given_as_an_array_are_validated_like_a_list():
    runs = np.array([[3, 0, 1], [5, 1, 2]], dtype=np.int64)
    assert validate_runs(runs, src_blocks=8, dst_blocks=8).tolist() == runs.tolist()
    for bad, ints in ((runs[:, :2], False), (runs.astype(float), True)):  # wrong shape; not ints
        with pytest.raises(UsageError) as ei:
            validate_runs(bad, src_blocks=8, dst_blocks=8, argument="runs")
        assert ei.value.argument == "runs" and ("of ints" in str(ei.value)) == ints
    as_objects = np.array([[3, 0, 1]], dtype=object)  # ints in an object array: converted, as a list is
    assert validate_runs(as_objects, src_blocks=8, dst_blocks=8).tolist() == [[3, 0, 1]]


# -- pool_spans / coalesce ---------------------------------------------------
SPEC = PoolSpec(num_blocks=8, block_stride=100, regions=(Region(0, 10), Region(50, 20)), base_offset=7)


def test_pool_spans_d2h_offsets():
    s = pool_spans(SPEC, host_offset=64, host_stride=256, runs=np.array([[2, 5, 1]]), to_host=True)
    assert sorted(zip(s.src.tolist(), s.dst.tolist(), s.length.tolist())) == [
        (7 + 200, 64 + 5 * 256, 10),
        (7 + 250, 64 + 5 * 256 + 10, 20),
    ]
    back = pool_spans(SPEC, host_offset=64, host_stride=256, runs=np.array([[5, 2, 1]]), to_host=False)
    assert byte_map(back) == {v: k for k, v in byte_map(s).items()}


def test_adjacent_runs_coalesce_into_one_span():
    contiguous = PoolSpec(num_blocks=8, block_stride=64, regions=(Region(0, 64),))
    split_runs = np.array([[0, 0, 1], [1, 1, 1], [2, 2, 2], [4, 4, 4]])
    s = pool_spans(contiguous, 0, 64, split_runs, to_host=True)
    assert (s.src.tolist(), s.dst.tolist(), s.length.tolist()) == ([0], [0], [512])
    gap = pool_spans(contiguous, 0, 64, np.array([[0, 0, 2], [3, 2, 2]]), to_host=True)
    assert sorted(zip(gap.src.tolist(), gap.length.tolist())) == [(0, 128), (192, 128)]
    # host side not adjacent: device 0,1 -> host 1,0 never merges
    swapped = pool_spans(contiguous, 0, 64, np.array([[0, 1, 1], [1, 0, 1]]), to_host=True)
    assert len(swapped) == 2


def test_padded_blocks_do_not_merge_across_padding():
    s = pool_spans(SPEC, 0, 30, np.array([[0, 0, 8]]), to_host=True)
    assert len(s) == 16 and s.nbytes == 8 * 30


def test_coalesce_merges_out_of_order_input():
    s = coalesce(spans([(20, 120, 10), (0, 100, 10), (10, 110, 10), (40, 0, 5)]))
    assert sorted(zip(s.src.tolist(), s.dst.tolist(), s.length.tolist())) == [(0, 100, 30), (40, 0, 5)]
    assert s.src.dtype == s.length.dtype == np.int64 and s.src.flags.c_contiguous


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 6), st.integers(0, 5), st.booleans()), min_size=1, max_size=25),
    st.randoms(use_true_random=False),
)
def test_coalesce_preserves_the_byte_mapping(pieces, rnd):
    # Lay pieces end to end on the source with random gaps; destinations follow or jump.
    rows, s, d = [], 0, 1000
    for n, gap, jump in pieces:
        rows.append((s, d, n))
        s += n + gap
        d += n + (17 if jump else 0)
    rnd.shuffle(rows)
    before = spans(rows)
    after = coalesce(before)
    assert byte_map(after) == byte_map(before)
    assert after.nbytes == before.nbytes
    end = after.src[:-1] + after.length[:-1]
    assert not ((end == after.src[1:]) & (after.dst[:-1] + after.length[:-1] == after.dst[1:])).any()


# -- split -------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=0, max_size=40), st.integers(1, 120))
def test_split_covers_every_span_once_in_order(lengths, max_bytes):
    n = len(lengths)
    s = Spans(np.arange(n, dtype=np.int64) * 100, np.arange(n, dtype=np.int64) * 200, np.array(lengths, dtype=np.int64))
    pieces = s.split(max_bytes)
    if n == 0:
        assert pieces == []
        return
    assert all(len(p) > 0 for p in pieces)
    assert np.concatenate([p.src for p in pieces]).tolist() == s.src.tolist()
    assert np.concatenate([p.length for p in pieces]).tolist() == lengths
    longest = max(lengths)
    assert all(p.nbytes <= max_bytes + longest for p in pieces)  # "~max_bytes": spans are never cut
    if sum(lengths) <= max_bytes:
        assert len(pieces) == 1


def test_split_cuts_at_byte_budget():
    s = spans([(i * 10, i * 10, 10) for i in range(10)])
    assert [p.nbytes for p in s.split(30)] == [30, 30, 30, 10]
    assert [p.nbytes for p in s.split(1000)] == [100]
    assert [p.nbytes for p in s.split(1)] == [10] * 10


# -- pool_pattern / block_copy: what the engine's kernel gets ------------------
def pattern_byte_map(bc: BlockCopy, src_base: int = 0, dst_base: int = 0) -> dict[int, int]:
    """Every source byte -> its destination byte, as copy_blocks moves them."""
    p = bc.pattern
    rows = [
        (sb + s, db + d, n)
        for sb, db in zip(bc.src.tolist(), bc.dst.tolist())
        for s, d, n in zip(p.src.tolist(), p.dst.tolist(), p.length.tolist())
    ]
    return byte_map(spans(rows or np.zeros((0, 3))))


def test_pattern_merges_regions_adjacent_on_both_sides():
    spec = PoolSpec(num_blocks=4, block_stride=64, regions=(Region(0, 8), Region(8, 8), Region(32, 8)))
    p = pool_pattern(spec, to_host=True)
    assert (p.src.tolist(), p.dst.tolist(), p.length.tolist(), p.block_nbytes) == ([0, 32], [0, 16], [16, 8], 24)
    back = pool_pattern(spec, to_host=False)
    assert (back.src.tolist(), back.dst.tolist()) == ([0, 16], [0, 32])


@given(
    st.lists(st.tuples(st.integers(0, 6), st.integers(1, 9)), min_size=1, max_size=6),
    st.permutations(range(8)),
    st.integers(1, 4),
    st.booleans(),
)
@settings(max_examples=60, deadline=None)
def test_block_copy_moves_exactly_the_bytes_pool_spans_names(gaps, perm, nruns, to_host):
    regions, at = [], 0
    for gap, n in gaps:
        regions.append(Region(at + gap, n))
        at += gap + n
    spec = PoolSpec(num_blocks=8, block_stride=at + 3, regions=tuple(regions))
    host_stride = sum(n for _, n in gaps) + 5
    runs = np.array([[perm[i], i, 1] for i in range(nruns)], dtype=np.int64)
    want = byte_map(pool_spans(spec, 0, host_stride, runs, to_host=to_host))
    got = block_copy(pool_pattern(spec, to_host=to_host), spec.block_stride, host_stride, runs, to_host=to_host)
    assert pattern_byte_map(got) == want and got.nbytes == len(want)


@given(st.integers(1, 40), st.integers(1, 5), st.integers(1, 300))
def test_block_copy_split_covers_every_block_once_in_order(blocks, per_block, max_bytes):
    pattern = pool_pattern(PoolSpec(num_blocks=64, block_stride=16, regions=(Region(0, per_block),)), to_host=True)
    runs = np.array([[i, 63 - i, 1] for i in range(blocks)], dtype=np.int64)
    whole = block_copy(pattern, 16, 8, runs, to_host=True)
    pieces = whole.split(max_bytes)
    assert np.concatenate([p.src for p in pieces]).tolist() == whole.src.tolist()
    assert np.concatenate([p.dst for p in pieces]).tolist() == whole.dst.tolist()
    assert all(p.nbytes <= max(max_bytes, per_block) for p in pieces)
