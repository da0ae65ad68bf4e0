"""KV resharding planner: byte-exact, exactly-once, across TP degrees, block sizes and orders."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _kvsim import expected_mask, global_kv, shard, unshard
from tiersync.disagg.geometry import KVOrder, PagedKVLayout
from tiersync.disagg.reshard import ReshardPlanner, plan_reshard
from tiersync.disagg.spanio import apply_plan
from tiersync.errors import UsageError

ORDERS = list(KVOrder)


def _layout(tp, bs, nb, order, heads=8, hd=4, layers=2, dtype="float16"):
    return PagedKVLayout(
        num_layers=layers,
        num_kv_heads=heads,
        head_dim=hd,
        block_size=bs,
        num_blocks=nb,
        dtype=dtype,
        tp_size=tp,
        order=order,
    )


def _table(rng, nb, n):
    return rng.permutation(nb)[:n].tolist()


def check_roundtrip(src, dst, num_tokens, seed=0):
    """Apply the plan to simulated ranks; assert value equality and exactly-once writes."""
    rng = np.random.default_rng(seed)
    sids = _table(rng, src.num_blocks, src.blocks_needed(num_tokens))
    dids = _table(rng, dst.num_blocks, dst.blocks_needed(num_tokens))
    kv = global_kv(src, num_tokens, seed)
    src_ranks = shard(src, kv, sids, fill=0xAB)
    dst_ranks = [[np.zeros(dst.layer_nbytes, np.uint8) for _ in range(dst.num_layers)] for _ in range(dst.tp_size)]
    plan = plan_reshard(src, dst, sids, dids, num_tokens)
    planner = ReshardPlanner()
    for s in range(src.tp_size):  # one route planned alone (a prefill rank's KV_OPEN) is the plan's
        for d in range(dst.tp_size):
            spans, readers = planner.route(src, dst, sids, dids, num_tokens, (s, d))
            np.testing.assert_array_equal(spans, plan.route_spans(s, d))
            assert readers == plan.readers_of(s)
    apply_plan(plan, src_ranks, dst_ranks)
    np.testing.assert_array_equal(unshard(dst, dst_ranks, dids, num_tokens), kv)
    mask = expected_mask(dst, dids, num_tokens)
    for d in range(dst.tp_size):
        count = np.zeros(dst.layer_nbytes, np.int64)
        for _, dst_off, n in [row for s in range(src.tp_size) for row in plan.route_spans(s, d).tolist()]:
            count[dst_off : dst_off + n] += 1
        np.testing.assert_array_equal(count, mask)  # every needed byte once, nothing else
        untouched = mask == 0
        assert not dst_ranks[d][0][untouched].any()
    return plan


@pytest.mark.parametrize("order_src", ORDERS)
@pytest.mark.parametrize("order_dst", ORDERS)
@pytest.mark.parametrize("a,b", [(1, 2), (2, 1), (2, 4), (4, 2)])
@pytest.mark.parametrize("bs_src,bs_dst", [(16, 16), (16, 32), (32, 16), (4, 6)])
def test_tp_and_block_size_roundtrip(a, b, bs_src, bs_dst, order_src, order_dst):
    num_tokens = 77
    src = _layout(a, bs_src, 40, order_src)
    dst = _layout(b, bs_dst, 40, order_dst)
    plan = check_roundtrip(src, dst, num_tokens)
    assert plan.spans[:, 4].sum() == 2 * num_tokens * 8 * src.head_nbytes


@pytest.mark.parametrize("a,b", [(4, 8), (8, 4), (2, 8), (8, 8), (8, 1)])
def test_replicated_heads_roundtrip_and_balance(a, b):
    src = _layout(a, 16, 12, KVOrder.KV_MAJOR, heads=2)
    dst = _layout(b, 16, 12, KVOrder.BLOCK_MAJOR, heads=2)
    plan = check_roundtrip(src, dst, 50)
    senders = [len(plan.readers_of(s)) for s in range(a)]
    assert max(senders) - min(x for x in senders if x) <= 1 or b < a  # readers spread over replicas
    if b >= a:
        assert not plan.idle_sources()
    assert set(plan.idle_sources()).isdisjoint(r.src_rank for r in plan.routes)


def test_same_layout_coalesces_to_block_runs():
    lay = _layout(2, 16, 8, KVOrder.BLOCK_MAJOR)
    plan = plan_reshard(lay, lay, [2, 3, 4], [5, 6, 7], 48)
    # identical geometry, consecutive blocks on both sides: one span per rank pair
    assert plan.spans.shape[0] == 2
    assert plan.route_nbytes(0, 0) == 3 * 2 * lay.block_nbytes
    assert plan.route_nbytes(0, 1) == 0


def test_transfers_cover_every_layer_and_plan_cache_hits():
    planner = ReshardPlanner()
    src, dst = _layout(2, 16, 8, KVOrder.KV_MAJOR, layers=3), _layout(4, 16, 8, KVOrder.KV_MAJOR, layers=3)
    p1 = planner.plan(src, dst, [0, 1], [1, 0], 20)
    p2 = planner.plan(src, dst, (0, 1), np.array([1, 0]), 20)
    assert p1 is p2 and len(planner) == 1
    rows = list(p1.transfers())
    assert {t.layer for t in rows} == {0, 1, 2}
    assert len(rows) == 3 * p1.spans.shape[0]
    assert planner.plan(src, dst, [0, 1], [1, 2], 20) is not p1


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_property_random_layouts(data):
    heads = data.draw(st.sampled_from([1, 2, 4, 8]))
    tps = [1, 2, 4, 8]
    a, b = data.draw(st.sampled_from(tps)), data.draw(st.sampled_from(tps))
    bs_src, bs_dst = data.draw(st.integers(1, 9)), data.draw(st.integers(1, 9))
    num_tokens = data.draw(st.integers(1, 40))
    hd = data.draw(st.sampled_from([1, 2, 3, 8]))
    dtype = data.draw(st.sampled_from(["float16", "float32", "int8", "bfloat16"]))
    src = _layout(
        a,
        bs_src,
        -(-num_tokens // bs_src) + data.draw(st.integers(0, 3)),
        data.draw(st.sampled_from(ORDERS)),
        heads=heads,
        hd=hd,
        layers=1,
        dtype=dtype,
    )
    dst = _layout(
        b,
        bs_dst,
        -(-num_tokens // bs_dst) + data.draw(st.integers(0, 3)),
        data.draw(st.sampled_from(ORDERS)),
        heads=heads,
        hd=hd,
        layers=1,
        dtype=dtype,
    )
    check_roundtrip(src, dst, num_tokens, seed=data.draw(st.integers(0, 1000)))


def _arg(excinfo):
    return excinfo.value.argument


def test_bad_heads_named():
    with pytest.raises(UsageError) as e:
        _layout(3, 16, 4, KVOrder.KV_MAJOR, heads=8)
    assert _arg(e) == "num_kv_heads"
    with pytest.raises(UsageError) as e:
        _layout(4, 16, 4, KVOrder.KV_MAJOR, heads=3)
    assert _arg(e) == "num_kv_heads"
    with pytest.raises(UsageError) as e:
        _layout(1, 16, 4, "row_major")
    assert _arg(e) == "order"


def test_sizes_beyond_any_real_layout_are_refused_naming_the_field():
    """A layout also comes off the wire (KV_OPEN): no count past 2**31 and no layer past 2**50
    bytes, so every offset stays far inside an int64 (2**40 blocks used to overflow later)."""
    from dataclasses import replace

    base = _layout(1, 16, 4, KVOrder.KV_MAJOR)
    for change, named in [
        ({"num_blocks": 2**40}, "num_blocks"),
        ({"tp_size": 2**32}, "tp_size"),
        ({"block_size": 2**31 + 1}, "block_size"),
        ({"num_blocks": 2**31, "head_dim": 2**12}, "num_blocks"),  # each field fits, a layer does not
    ]:
        with pytest.raises(UsageError) as e:
            replace(base, **change)
        assert _arg(e) == named, change


@pytest.mark.parametrize("field,value", [("head_dim", 8), ("dtype", "float32"), ("layers", 3), ("heads", 4)])
def test_mismatch_named(field, value):
    src = _layout(2, 16, 4, KVOrder.KV_MAJOR)
    dst = _layout(2, 16, 4, KVOrder.KV_MAJOR, **{{"head_dim": "hd"}.get(field, field): value})
    name = {"layers": "num_layers", "heads": "num_kv_heads"}.get(field, field)
    with pytest.raises(UsageError) as e:
        plan_reshard(src, dst, [0], [0], 10)
    assert _arg(e) == f"dst.{name}"


def test_block_table_errors_named():
    src, dst = _layout(1, 16, 4, KVOrder.KV_MAJOR), _layout(2, 8, 8, KVOrder.KV_MAJOR)
    cases = [
        (([0], [0, 1, 2], 17), "src_block_ids"),  # 17 tokens need 2 source blocks
        (([0, 1], [0, 1], 17), "dst_block_ids"),  # ... and 3 destination blocks
        (([0, 9], [0, 1, 2], 17), "src_block_ids"),  # out of range
        (([0, 1], [0, 1, 1], 17), "dst_block_ids"),  # duplicate destination block
        (([0, 1], [0.5, 1, 2], 17), "dst_block_ids"),  # not integers
        (([0, 1], [0, 1, 2], 0), "num_tokens"),
    ]
    for (sids, dids, n), name in cases:
        with pytest.raises(UsageError) as e:
            plan_reshard(src, dst, sids, dids, n)
        assert _arg(e) == name, (sids, dids, n)
    with pytest.raises(UsageError) as e:
        plan_reshard(src, "tp2", [0], [0], 1)
    assert _arg(e) == "dst"


def test_layout_pool_specs_and_dict_roundtrip():
    for order in ORDERS:
        lay = _layout(2, 16, 5, order)
        k, v = lay.pool_specs()
        assert (k.tag, v.tag) == ("k", "v") and k.block_nbytes == lay.block_nbytes
        assert max(k.extent, v.extent) == lay.layer_nbytes
        assert lay.offset(1, 3, 2, 1) == v.base_offset + 3 * v.block_stride + 2 * lay.token_stride() + lay.head_stride()
        assert PagedKVLayout.from_dict(lay.to_dict()) == lay
    with pytest.raises(UsageError) as e:
        PagedKVLayout.from_dict({"num_layers": 1}, argument="source.layout")
    assert _arg(e) == "source.layout"


def test_dtype_names_normalised_and_bad_dtype_named():
    class TorchLike:
        def __str__(self):
            return "torch.bfloat16"

    assert _layout(1, 16, 4, KVOrder.KV_MAJOR, dtype=TorchLike()).dtype == "bfloat16"
    assert _layout(1, 16, 4, KVOrder.KV_MAJOR, dtype=np.float32).itemsize == 4
    with pytest.raises(UsageError) as e:
        _layout(1, 16, 4, KVOrder.KV_MAJOR, dtype="object")
    assert _arg(e) == "dtype"


def test_import_tiersync_stays_cheap():
    import subprocess
    import sys

    code = "import sys, tiersync; print(any(m.startswith(('tiersync.disagg', 'numpy')) for m in sys.modules))"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )


def test_one_route_costs_what_that_route_moves_whatever_layout_the_reader_names():
    """A reader's KV_OPEN names its own layout: TP 256 with 1-token blocks makes the whole plan of
    a 4096-token request about a million spans (K and V of each token, for each destination
    rank) from this prefill rank; the route the reader reads is a 256th of them. The prefill rank
    plans only that route, in a 20th of the memory or less."""
    import tracemalloc

    src = _layout(1, 16, 256, KVOrder.HEAD_MAJOR)
    dst = _layout(256, 1, 4096, KVOrder.HEAD_MAJOR)
    rng = np.random.default_rng(3)
    sids, dids = _table(rng, 256, 256), _table(rng, 4096, 4096)
    planner = ReshardPlanner()
    tracemalloc.start()
    try:
        spans, readers = planner.route(src, dst, sids, dids, 4096, (0, 5))
        one = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        whole = planner.plan(src, dst, sids, dids, 4096)
        all_routes = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert readers == tuple(range(256))
    np.testing.assert_array_equal(spans, whole.route_spans(0, 5))
    assert whole.spans.shape[0] > 200 * spans.shape[0] > 200 * 4000
    assert 20 * one < all_routes, (one, all_routes)


def _per_token_spans(src, dst, sids, dids, num_tokens):
    """The plan's spans as tiersync computed them before 2026-12-07: a span per token, K/V and
    head (or the route's heads together where contiguous on both sides), then coalesced."""
    from tiersync.disagg.reshard import coalesce

    rows = []
    t = np.arange(num_tokens, dtype=np.int64)

    def offsets(layout, table, kv, head):
        block = np.asarray(table[: layout.blocks_needed(num_tokens)], np.int64)[t // layout.block_size]
        return (
            layout.kv_base(kv)
            + block * layout.block_stride()
            + (t % layout.block_size) * layout.token_stride()
            + head * layout.head_stride()
        )

    for r in ReshardPlanner().routes(src, dst):
        joint = src.head_stride() == src.head_nbytes and dst.head_stride() == dst.head_nbytes
        heads = [0] if joint else range(r.nheads)
        parts = [
            (offsets(src, sids, kv, r.src_head + j), offsets(dst, dids, kv, r.dst_head + j))
            for kv in (0, 1)
            for j in heads
        ]
        s, d = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        width = r.nheads * src.head_nbytes if joint else src.head_nbytes
        spans = coalesce(s, d, np.full(s.size, width, np.int64))
        rows.append(
            np.column_stack(
                [np.full(len(spans), r.src_rank), spans[:, 0], np.full(len(spans), r.dst_rank), spans[:, 1:]]
            )
        )
    out = np.concatenate(rows)
    return out[np.lexsort((out[:, 1], out[:, 0], out[:, 2]))]


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_spans_planned_a_run_of_tokens_at_a_time_are_those_of_a_token_at_a_time(data):
    """Pieces contiguous across tokens are planned a run of tokens at a time (12 ms became under
    1 ms for a 6000-token head-major request); once coalesced the spans (and so the digest a
    producer and a reader of another tiersync version compare) are exactly as before."""
    heads = data.draw(st.sampled_from([1, 2, 4, 8]))
    a, b = data.draw(st.sampled_from([1, 2, 4, 8])), data.draw(st.sampled_from([1, 2, 4, 8]))
    src = _layout(a, data.draw(st.sampled_from([1, 3, 4, 16])), 48, data.draw(st.sampled_from(ORDERS)), heads=heads)
    dst = _layout(b, data.draw(st.sampled_from([1, 2, 6, 16])), 48, data.draw(st.sampled_from(ORDERS)), heads=heads)
    num_tokens = data.draw(st.integers(1, 40))
    rng = np.random.default_rng(data.draw(st.integers(0, 1000)))
    sids, dids = _table(rng, 48, src.blocks_needed(num_tokens)), _table(rng, 48, dst.blocks_needed(num_tokens))
    plan = ReshardPlanner().plan(src, dst, sids, dids, num_tokens)
    np.testing.assert_array_equal(plan.spans, _per_token_spans(src, dst, sids, dids, num_tokens))
