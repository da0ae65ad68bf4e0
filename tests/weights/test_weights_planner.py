"""Unit tests for the resharding planner, its cache, trees and the local executor."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from tiersync.errors import UsageError
from tiersync.weights import (
    Mesh,
    PlanCache,
    PlanOptions,
    Sharding,
    TensorSpec,
    TransferKind,
    allocate_destination,
    dtype_info,
    execute_local,
    plan_transfer,
    shard_slices,
)


def _mesh(n, name="x"):
    return Mesh((n,), (name,))


_RNG = np.random.default_rng(0)  # one stream for every _roundtrip call: each draws fresh data


def _roundtrip(plan, rng=_RNG):
    """Execute ``plan`` on random data; assert every destination shard equals its slice."""
    globals_ = {}
    src = {}
    for name, spec in plan.tensors.items():
        raw = rng.integers(0, 256, size=int(np.prod(spec.shape)) * spec.itemsize, dtype=np.uint8)
        g = raw.view(spec.dtype).reshape(spec.shape)
        globals_[name] = g
        for rank, sl in shard_slices(spec.shape, plan.source[name]).items():
            src.setdefault(rank, {})[name] = np.ascontiguousarray(g[sl])
    out = execute_local(plan, src)
    for name, spec in plan.tensors.items():
        for rank, sl in shard_slices(spec.shape, plan.destination[name]).items():
            assert out[rank][name].tobytes() == np.ascontiguousarray(globals_[name][sl]).tobytes()
    return out


def test_tp8_to_tp4_plan_and_roundtrip():
    src = Sharding(_mesh(8, "tp"), (None, "tp"))
    dst = Sharding(_mesh(4, "tp"), (None, "tp"))
    plan = plan_transfer(src, dst, {"w": ((6, 16), "float32")}, cache=None)
    assert len(plan.transfers) == 8
    for rank in range(4):
        chunks = plan.for_destination(rank)
        assert sorted(t.src_rank for t in chunks) == [2 * rank, 2 * rank + 1]
        assert all(t.src_span.is_contiguous for t in chunks)
        assert all(t.dst_span.row_bytes == 8 and t.dst_span.row_count == 6 for t in chunks)
    assert plan.chunk_counts() == {(r, "w"): 2 for r in range(4)}
    _roundtrip(plan)


def test_cache_returns_same_object_for_equal_inputs():
    cache = PlanCache(maxsize=2)
    mesh = Mesh((2, 2), ("dp", "tp"))
    tensors = {"a": ((4, 4), "float16"), "b": TensorSpec((3,), np.dtype("int8"))}
    p1 = plan_transfer(Sharding(mesh, ("tp",)), Sharding(_mesh(2), ()), tensors, cache=cache)
    p2 = plan_transfer(
        Sharding(Mesh((2, 2), ("dp", "tp")), (("tp",),)),
        {"a": Sharding(_mesh(2), ()), "b": Sharding(_mesh(2), ()), "extra": None},
        {"b": ((3,), "int8"), "a": ([4, 4], np.float16)},
        cache=cache,
    )
    assert p1 is p2 and cache.hits == 1 and cache.misses == 1
    p3 = plan_transfer(Sharding(mesh, ("tp",)), Sharding(_mesh(2), ()), tensors, PlanOptions(fanout=1), cache=cache)
    assert p3 is not p1
    plan_transfer(Sharding(mesh, ()), Sharding(_mesh(2), ()), tensors, cache=cache)
    assert len(cache) == 2  # LRU bound
    assert plan_transfer(Sharding(mesh, ("tp",)), Sharding(_mesh(2), ()), tensors, cache=None) is not p1


def test_default_cache_is_used():
    args = (Sharding(_mesh(2), ("x",)), Sharding(_mesh(3), ("x",)), {"w": ((7,), "uint8")})
    assert plan_transfer(*args) is plan_transfer(*args)


def _reference_modulo_loads(plan):
    """Pusher bytes under the reference rule candidates[dst_index % len(candidates)]."""
    loads = {}
    for t in plan.transfers:
        spec, src = plan.tensors[t.tensor], plan.source[t.tensor]
        holders = sorted(
            r
            for r, sl in shard_slices(spec.shape, src).items()
            if all(s.start <= a and b <= s.stop for s, a, b in zip(sl, t.global_box.start, t.global_box.stop))
        )
        p = holders[t.dst_rank % len(holders)]
        loads[p] = loads.get(p, 0) + t.nbytes
    return loads


def test_pushers_balance_better_than_modulo():
    # 15 rows over 8 destination shards: seven 1-row shards and one 8-row shard.
    src = Sharding.replicated(_mesh(4))
    dst = Sharding(_mesh(8), ("x",))
    plan = plan_transfer(src, dst, {"w": ((15, 4), "float32")}, cache=None)
    greedy = plan.sent_bytes()
    modulo = _reference_modulo_loads(plan)
    assert max(modulo.values()) == 9 * 16
    assert max(greedy.values()) == 8 * 16
    assert sum(greedy.values()) == 15 * 16
    _roundtrip(plan)


def test_pushers_spread_over_many_tensors():
    src = Sharding.replicated(_mesh(4))
    dst = Sharding.replicated(_mesh(1))
    tensors = {f"layer{i}": ((10 + i, 8), "float32") for i in range(12)}
    plan = plan_transfer(src, dst, tensors, cache=None)
    loads = plan.sent_bytes()
    total, biggest = sum(loads.values()), max(t.nbytes for t in plan.transfers)
    assert len(loads) == 4 and max(loads.values()) <= total / 4 + biggest
    _roundtrip(plan)


def _min_depth(n, k):
    depth, reached, level = 0, 0, 1
    while reached < n:
        level *= k
        reached += level
        depth += 1
    return depth


@pytest.mark.parametrize("n, k", [(1, 64), (64, 64), (65, 64), (300, 4), (1000, 8), (200, 2), (4100, 64)])
def test_tree_broadcast_reaches_everyone_once(n, k):
    plan = plan_transfer(
        Sharding.replicated(_mesh(2)),
        Sharding.replicated(_mesh(n)),
        {"w": ((3, 5), "int32")},
        PlanOptions(fanout=k),
        cache=None,
    )
    got = [t.dst_rank for t in plan.transfers]
    assert sorted(got) == list(range(n))
    assert plan.depth == _min_depth(n, k)
    if k > 1:
        assert plan.depth <= int(np.ceil(np.log(n) / np.log(k))) + 1
    stage_of = {t.dst_rank: t.stage for t in plan.transfers}
    sends = {}
    for t in plan.transfers:
        sends[(t.kind, t.src_rank)] = sends.get((t.kind, t.src_rank), 0) + 1
        if t.kind is TransferKind.RELAY:
            assert stage_of[t.src_rank] == t.stage - 1
        else:
            assert t.stage == 0
    assert all(v <= k for (kind, _), v in sends.items() if kind is TransferKind.RELAY)
    assert sum(v for (kind, _), v in sends.items() if kind is TransferKind.PUSH) == min(n, k)
    _roundtrip(plan)


def test_relay_work_rotates_across_chunks():
    tensors = {f"t{i}": ((4,), "float32") for i in range(8)}
    plan = plan_transfer(
        Sharding.replicated(_mesh(1)), Sharding.replicated(_mesh(9)), tensors, PlanOptions(fanout=2), cache=None
    )
    relays = {t.src_rank for t in plan.transfers if t.kind is TransferKind.RELAY}
    assert len(relays) > 4  # not always the same two or three ranks
    _roundtrip(plan)


def test_segments_pipeline_large_chunks():
    plan = plan_transfer(
        Sharding.replicated(_mesh(1)),
        Sharding.replicated(_mesh(10)),
        {"w": ((64, 16), "float32")},
        PlanOptions(fanout=3, segment_bytes=1024),
        cache=None,
    )
    assert {t.nbytes for t in plan.transfers} == {1024}
    assert plan.chunk_counts()[(0, "w")] == 4
    assert len(plan.stages()) == plan.depth == 2
    _roundtrip(plan)


def test_segments_cut_inner_dimensions_when_one_slice_is_larger():
    """(experts, rows, cols): one expert (4 KiB) exceeds segment_bytes, so it is cut by rows:
    no GET is larger than segment_bytes (the wire bounds one frame)."""
    plan = plan_transfer(
        Sharding.replicated(_mesh(1)),
        Sharding.replicated(_mesh(2)),
        {"w": ((3, 64, 16), "float32")},
        PlanOptions(fanout=1, segment_bytes=1000),
        cache=None,
    )
    assert max(t.nbytes for t in plan.transfers) == 960 and plan.chunk_counts()[(0, "w")] == 3 * 5  # 15 rows each
    _roundtrip(plan)


def test_foreign_dtypes_by_name():
    class FakeTorchDtype:
        def __str__(self):
            return "torch.bfloat16"

    assert dtype_info(FakeTorchDtype()) == ("bfloat16", 2)
    assert dtype_info("float8_e4m3fn") == ("float8_e4m3fn", 1)
    assert dtype_info(np.float32) == ("float32", 4)
    plan = plan_transfer(
        Sharding(_mesh(2), ("x",)), Sharding(_mesh(3), (None, "x")), {"w": ((4, 6), "bfloat16")}, cache=None
    )
    dst = allocate_destination(plan)
    assert dst[0]["w"].shape == (4, 2, 2) and dst[0]["w"].dtype == np.uint8
    src = {r: {"w": np.full((2, 6, 2), r + 1, np.uint8)} for r in range(2)}
    execute_local(plan, src, dst)
    assert dst[1]["w"][:2].min() == 1 and dst[1]["w"][2:].min() == 2


@pytest.mark.parametrize(
    "call, argument",
    [
        (lambda s, d: plan_transfer(s, d, [("w", ((4,), "f4"))]), "tensors"),
        (lambda s, d: plan_transfer(s, d, {"": ((4,), "f4")}), "tensors"),
        (lambda s, d: plan_transfer(s, d, {"w": (4,)}), "tensors"),
        (lambda s, d: plan_transfer(s, d, {"w": ((4,), "nonsense")}), "dtype"),
        (lambda s, d: plan_transfer(s, d, {"w": ((4,), None)}), "dtype"),
        (lambda s, d: plan_transfer(s, d, {"w": ((4,), object)}), "dtype"),
        (lambda s, d: plan_transfer(s, d, {"w": ((-4,), "f4")}), "shape"),
        (lambda s, d: plan_transfer(s, d, {"w": (4, "f4")}), "shape"),
        (lambda s, d: plan_transfer(s, d, {"w": ((), "f4")}), "source"),
        (lambda s, d: plan_transfer("tp", d, {"w": ((4,), "f4")}), "source"),
        (lambda s, d: plan_transfer(s, {}, {"w": ((4,), "f4")}), "destination"),
        (lambda s, d: plan_transfer(s, {"w": "x"}, {"w": ((4,), "f4")}), "destination"),
        (lambda s, d: plan_transfer(s, d, {"w": ((4,), "f4")}, options={"fanout": 2}), "options"),
        (lambda s, d: plan_transfer(s, d, {"w": ((4,), "f4")}, cache={}), "cache"),
        (lambda s, d: PlanOptions(fanout=0), "fanout"),
        (lambda s, d: PlanOptions(segment_bytes=0), "segment_bytes"),
        (lambda s, d: PlanCache(0), "maxsize"),
    ],
)
def test_bad_input_names_the_argument(call, argument):
    src, dst = Sharding(_mesh(2), ("x",)), Sharding(_mesh(2), ())
    with pytest.raises(UsageError) as info:
        call(src, dst)
    assert info.value.argument == argument
    assert str(info.value).startswith(f"{argument}:")


def test_execute_local_rejects_bad_shards():
    plan = plan_transfer(Sharding(_mesh(2), ("x",)), Sharding(_mesh(2), ()), {"w": ((4,), "float32")}, cache=None)
    good = {r: {"w": np.zeros(2, np.float32)} for r in range(2)}
    cases = [
        ({0: good[0]}, None, "src_shards"),
        ({0: {"w": np.zeros(3, np.float32)}, 1: good[1]}, None, "src_shards"),
        ({0: {"w": np.zeros(2, np.int32)}, 1: good[1]}, None, "src_shards"),
        ({0: {"w": np.zeros(4, np.float32)[::2]}, 1: good[1]}, None, "src_shards"),
        ({0: {"w": [0.0, 0.0]}, 1: good[1]}, None, "src_shards"),
        (good, {0: {"w": np.zeros(4, np.float32)}}, "dst_shards"),
        (good, {r: {"w": np.zeros(2, np.float32)} for r in range(2)}, "dst_shards"),
    ]
    for src, dst, argument in cases:
        with pytest.raises(UsageError) as info:
            execute_local(plan, src, dst)
        assert info.value.argument == argument
    ro = np.zeros(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(UsageError) as info:
        execute_local(plan, good, {0: {"w": ro}, 1: {"w": np.zeros(4, np.float32)}})
    assert info.value.argument == "dst_shards"
    with pytest.raises(UsageError) as info:
        execute_local("plan", good)  # type: ignore[arg-type]
    assert info.value.argument == "plan"


def test_plan_is_deterministic():
    args = (
        Sharding(Mesh((2, 3), ("a", "b")), ("b", "a")),
        Sharding(Mesh((5,), ("x",)), (None, "x")),
        {"w": ((7, 11), "float64"), "v": ((13, 5), "int16")},
    )
    p1, p2 = plan_transfer(*args, cache=None), plan_transfer(*args, cache=None)
    assert p1.transfers == p2.transfers and p1 is not p2


def test_empty_and_zero_sized_tensors():
    plan = plan_transfer(Sharding(_mesh(2), ("x",)), Sharding(_mesh(3), ("x",)), {"z": ((0, 4), "f4")}, cache=None)
    assert plan.transfers == () and plan.depth == 0 and plan.stages() == ()
    out = execute_local(plan, {})
    assert out[2]["z"].shape == (0, 4)


def test_import_does_not_pull_torch_or_jax():
    code = "import sys, tiersync.weights; assert 'torch' not in sys.modules and 'jax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_nd_strided_spans_roundtrip():
    src = Sharding.replicated(_mesh(2))
    dst = Sharding(Mesh((2, 2, 2), ("a", "b", "c")), ("a", "b", "c"))
    plan = plan_transfer(src, dst, {"w": ((4, 6, 9), "float32")}, cache=None)
    spans = {t.src_span for t in plan.transfers}
    assert any(len(s.counts) == 2 and s.row_stride is None for s in spans)
    first = plan.for_destination(0)[0]
    assert first.src_span.counts == (2, 3) and first.src_span.strides == (216, 36)
    assert first.src_span.row_bytes == 16
    _roundtrip(plan)
