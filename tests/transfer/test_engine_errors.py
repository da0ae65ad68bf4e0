"""Refused engine calls: a clear error naming the argument, and nothing changed."""

from __future__ import annotations

import numpy as np
import pytest

from _kvpools import HOST_SENTINEL, make_pool
from tiersync.errors import UsageError
from tiersync.layout.adapters import kv_layout
from tiersync.layout.pool import Device, DevicePool, KVLayout
from tiersync.tiers.host import HostArena, HostArenaConfig
from tiersync.transfer.engine import TransferConfig, TransferEngine

NUM_DEV, NUM_HOST = 16, 8


@pytest.fixture
def setup():
    rng = np.random.default_rng(0)
    pools = [make_pool("numpy", np.float16, rng, num_blocks=NUM_DEV) for _ in range(2)]
    layout = kv_layout([(pools[0].tensor, pools[1].tensor)])
    arena = HostArena.for_layout(layout, NUM_HOST)
    arena.memory[:] = HOST_SENTINEL
    eng = TransferEngine(layout, arena, TransferConfig(workers=2, chunk_bytes=1024))
    locked = arena.allocate(4)  # blocks 0..3 locked
    arena.allocate(1)  # block 4 locked ...
    arena.allocator.unlock([4])  # ... then cached
    yield pools, arena, eng, locked
    eng.close()
    arena.close()


def state(pools, arena):
    a = arena.allocator
    return (
        (a.num_free, a.num_locked, a.num_cached, tuple(a.lock_count(b) for b in range(NUM_HOST))),
        arena.memory.tobytes(),
        tuple(p.snapshot() for p in pools),
    )


BAD_RUNS = [
    ("d2h", [(-1, 0, 1)], "runs[0]", "out of range"),
    ("d2h", [(NUM_DEV, 0, 1)], "runs[0]", "out of range"),
    ("d2h", [(0, 0, 1), (NUM_DEV - 1, 1, 2)], "runs[1]", "out of range"),  # overruns the device pool
    ("d2h", [(0, NUM_HOST - 1, 2)], "runs[0]", "out of range"),  # overruns the arena
    ("d2h", [(0, -1, 1)], "runs[0]", "out of range"),
    ("d2h", [(2**63 - 1, 0, 1)], "runs[0]", "out of range"),
    ("d2h", [(0, 0, 2), (1, 2, 1)], "runs", "named twice"),  # device block twice
    ("d2h", [(0, 1, 1), (5, 1, 1)], "runs", "named twice"),  # host block twice
    ("d2h", [(0, 0, 0)], "runs[0]", "count"),
    ("d2h", [(0, 0, 1), (1, 1, -1)], "runs[1]", "count"),
    ("d2h", [], "runs", "no runs"),
    ("d2h", [(0, 0)], "runs", "(src_block, dst_block, count)"),
    ("d2h", [(0, 0, 1.0)], "runs", "ints"),
    ("d2h", "abc", "runs", "(src_block, dst_block, count)"),
    ("d2h", [(0, 4, 1)], "runs", "locked"),  # host block cached
    ("d2h", [(0, 6, 1)], "runs", "locked"),  # host block free
    ("d2h", [(0, 2, 3)], "runs", "locked"),  # run reaches free blocks
    ("h2d", [(NUM_HOST, 0, 1)], "runs[0]", "out of range"),
    ("h2d", [(0, NUM_DEV, 1)], "runs[0]", "out of range"),
    ("h2d", [(0, 0, 1), (0, 1, 1)], "runs", "named twice"),  # host block twice
    ("h2d", [(0, 3, 1), (1, 3, 1)], "runs", "named twice"),  # device block twice
    ("h2d", [(5, 0, 1)], "runs", "locked"),
]


@pytest.mark.parametrize("method, runs, argument, words", BAD_RUNS)
def test_bad_runs_are_refused_and_change_nothing(setup, method, runs, argument, words):
    pools, arena, eng, _ = setup
    before = state(pools, arena)
    with pytest.raises(UsageError) as ei:
        getattr(eng, method)(runs)
    assert ei.value.argument == argument and words in str(ei.value)
    assert state(pools, arena) == before
    eng.close()  # anything that had slipped into the queue would have run by now
    assert state(pools, arena) == before


def test_h2d_into_read_only_pool_is_refused():
    rng = np.random.default_rng(1)
    ro = make_pool("numpy", np.float32, rng, num_blocks=NUM_DEV)
    ro.tensor.flags.writeable = False
    ro_layout = kv_layout([ro.tensor])
    ro_arena = HostArena.for_layout(ro_layout, 4)
    with TransferEngine(ro_layout, ro_arena) as eng:
        hb = ro_arena.allocate(2)
        eng.d2h([(3, hb[0], 1)]).result(timeout=60)  # reading a read-only pool is fine
        before = ro.snapshot()
        with pytest.raises(UsageError) as ei:
            eng.h2d([(hb[0], 0, 1)])
        assert ei.value.argument == "layout.pools[0]" and "read-only" in str(ei.value)
    assert ro.snapshot() == before
    ro_arena.close()


def test_engine_construction_is_checked(setup):
    pools, arena, _, _ = setup
    layout = kv_layout([(pools[0].tensor, pools[1].tensor)])
    with pytest.raises(UsageError) as ei:
        TransferEngine("layout", arena)
    assert ei.value.argument == "layout"
    with pytest.raises(UsageError) as ei:
        TransferEngine(layout, object())
    assert ei.value.argument == "arena"
    small = HostArena(HostArenaConfig(num_blocks=2, block_nbytes=layout.host_block_nbytes - 64))
    with pytest.raises(UsageError) as ei:
        TransferEngine(layout, small)
    assert ei.value.argument == "arena" and ei.value.context["needed"] == layout.host_block_nbytes
    small.close()
    p = layout.pools[0]
    cuda = DevicePool(spec=p.spec, device=Device.CUDA, address=0, nbytes=p.nbytes)
    with pytest.raises(UsageError) as ei:
        TransferEngine(KVLayout((cuda,)), arena)
    assert ei.value.argument == "layout" and ei.value.context["devices"] == ["cuda"]


@pytest.mark.parametrize(
    "kw, argument",
    [
        (dict(workers=0), "TransferConfig.workers"),
        (dict(workers=-1), "TransferConfig.workers"),
        (dict(workers=2.0), "TransferConfig.workers"),
        (dict(workers=True), "TransferConfig.workers"),
        (dict(max_inflight_bytes=0), "TransferConfig.max_inflight_bytes"),
        (dict(max_inflight_bytes="1"), "TransferConfig.max_inflight_bytes"),
        (dict(chunk_bytes=-4096), "TransferConfig.chunk_bytes"),
        (dict(bandwidth_gbps=0), "TransferConfig.bandwidth_gbps"),
        (dict(bandwidth_gbps=-1.5), "TransferConfig.bandwidth_gbps"),
        (dict(bandwidth_gbps=float("nan")), "TransferConfig.bandwidth_gbps"),
        (dict(bandwidth_gbps="10"), "TransferConfig.bandwidth_gbps"),
        (dict(bandwidth_gbps=True), "TransferConfig.bandwidth_gbps"),
    ],
)
def test_transfer_config_rejects_bad_values(kw, argument):
    with pytest.raises(UsageError) as ei:
        TransferConfig(**kw)
    assert ei.value.argument == argument


def test_transfer_config_accepts_good_values():
    c = TransferConfig(workers=1, max_inflight_bytes=1, chunk_bytes=1, bandwidth_gbps=2)
    assert c.bandwidth_gbps == 2 and TransferConfig(bandwidth_gbps=0.5).bandwidth_gbps == 0.5
