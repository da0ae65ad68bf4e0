"""Byte-exact d2h/h2d through the TransferEngine (tiersync.transfer.engine)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from _isolated import run_without_leaking_jax
from _kvpools import HOST_SENTINEL, SENTINEL, host_live_mask, host_segment, make_pool
from tiersync.errors import ClosedError, UsageError
from tiersync.layout.adapters import kv_layout
from tiersync.layout.pool import Device
from tiersync.tiers.allocator import BlockState
from tiersync.tiers.host import HostArena
from tiersync.transfer.engine import TransferConfig, TransferEngine
from tiersync.transfer.future import Direction, TransferStatus

torch = pytest.importorskip("torch")
SMALL = TransferConfig(workers=3, chunk_bytes=4096, max_inflight_bytes=16384)


@pytest.fixture
def rig():
    """rig(layers, num_host, config) -> (layout, arena, engine); closed at teardown."""
    made = []

    def build(layers, num_host=24, config=SMALL, tags=None):
        layout = kv_layout(layers, tags=tags)
        arena = HostArena.for_layout(layout, num_host)
        arena.memory[:] = HOST_SENTINEL
        eng = TransferEngine(layout, arena, config)
        made.append((eng, arena))
        return layout, arena, eng

    yield build
    for eng, arena in made:
        eng.close()
        arena.close()


def roundtrip(pools, layout, arena, eng, rng, dev_ids, host_ids, *, runs=None):
    """d2h dev_ids -> host_ids, check the host image, scramble, h2d back, check the storage."""
    host_ids = list(host_ids)
    got = arena.allocate(arena.num_blocks)  # lock everything; we address blocks by id
    assert sorted(got) == list(range(arena.num_blocks))
    before = [p.snapshot() for p in pools]
    d2h_runs = runs if runs is not None else [(d, h, 1) for d, h in zip(dev_ids, host_ids)]
    fut = eng.d2h(d2h_runs)
    fut.result(timeout=60)
    assert fut.status is TransferStatus.DONE and fut.direction is Direction.D2H
    assert fut.nbytes == len(dev_ids) * layout.block_nbytes
    mask = host_live_mask(arena, layout)
    for d, h in zip(dev_ids, host_ids):
        for j, p in enumerate(pools):
            assert host_segment(arena, layout, j, h) == p.block(d), (j, d, h)
        assert (arena.memory[h][~mask] == HOST_SENTINEL).all()  # host padding never written
    assert [p.snapshot() for p in pools] == before  # d2h does not write the device
    for p in pools:
        p.scramble(rng)
    scrambled = [p.snapshot() for p in pools]
    eng.h2d([(h, d, 1) for d, h in zip(dev_ids, host_ids)]).result(timeout=60)
    moved = np.zeros(pools[0].blocks.shape[0], dtype=bool)
    moved[list(dev_ids)] = True
    for p, b, s in zip(pools, before, scrambled):
        want = np.frombuffer(s, dtype=np.uint8).copy()
        idx = p.blocks[moved].reshape(-1)
        want[idx] = np.frombuffer(b, dtype=np.uint8)[idx]
        assert p.snapshot() == want.tobytes()  # moved blocks restored, others and padding untouched
        assert (p.u8[~p.live] == SENTINEL).all()


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.int8, np.complex64])
def test_numpy_padded_pools_roundtrip(rig, dtype):
    rng = np.random.default_rng(0)
    pools = [make_pool("numpy", dtype, rng) for _ in range(4)]
    layout, arena, eng = rig([(pools[0].tensor, pools[1].tensor), (pools[2].tensor, pools[3].tensor)])
    dev = rng.permutation(16)[:11].tolist()
    host = rng.permutation(24)[:11].tolist()
    roundtrip(pools, layout, arena, eng, rng, dev, host)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_torch_kv_per_layer_roundtrip(rig, dtype):
    rng = np.random.default_rng(1)
    pools = [make_pool("torch", dtype, rng, pad=pad, lead=lead) for pad, lead in ((8, 1), (0, 0)) * 3]
    layers = [(pools[2 * layer].tensor, pools[2 * layer + 1].tensor) for layer in range(3)]
    layout, arena, eng = rig(layers, tags=("k", "v"))
    assert [p.spec.tag for p in layout.pools] == ["k", "v"] * 3
    dev = rng.permutation(16).tolist()
    host = rng.permutation(24)[:16].tolist()
    roundtrip(pools, layout, arena, eng, rng, dev, host)


def test_python_fallback_backend_roundtrip(rig):
    rng = np.random.default_rng(2)
    pools = [make_pool("numpy", np.float32, rng, dim=1200, pad=100)]  # spans >= 4 KiB: streaming path
    layout, arena, eng = rig([pools[0].tensor])
    eng.close()
    eng = TransferEngine(layout, arena, TransferConfig(backend="python-memmove"))
    assert type(eng.backends[Device.CPU]).__name__ == "MemmoveCopier"
    roundtrip(pools, layout, arena, eng, rng, [3, 1, 7], [0, 9, 4])
    assert eng.backends[Device.CPU].stats.blocks == 6
    eng.close()


def test_small_request_is_shared_by_every_worker(rig):
    rng = np.random.default_rng(22)
    p = make_pool("numpy", np.float32, rng, dim=1 << 16)  # 256 KiB blocks
    layout, arena, _ = rig([p.tensor], num_host=16)
    eng = TransferEngine(layout, arena, TransferConfig(workers=2))  # default chunk_bytes: 8 MiB
    host = arena.allocate(16)
    parts, piece = eng._plan(np.array([[d, host[d], 1] for d in range(16)], dtype=np.int64), True)
    assert piece == max(16 * layout.host_block_nbytes // eng.config.workers, 1 << 20)
    assert len(eng._pack(parts, piece)) == eng.config.workers
    with eng:
        eng.d2h([(d, host[d], 1) for d in range(16)]).result(timeout=60)
    assert arena.memory[host].tobytes() == np.ascontiguousarray(p.tensor[:16]).tobytes()


def test_jax_cpu_arrays_roundtrip():
    run_without_leaking_jax("""
        import jax.numpy as jnp
        import numpy as np
        from tiersync.layout.adapters import kv_layout
        from tiersync.tiers.host import HostArena
        from tiersync.transfer.engine import TransferConfig, TransferEngine
        cfg = TransferConfig(workers=3, chunk_bytes=4096, max_inflight_bytes=16384)
        rng = np.random.default_rng(3)
        src = [jnp.array(rng.standard_normal((8, 4, 16)).astype(np.float32)) for _ in range(2)]
        src.append(jnp.array(rng.standard_normal((8, 32)), dtype=jnp.bfloat16))
        dst = [jnp.array(np.zeros((8, 4, 16), np.float32)) for _ in range(2)]
        dst.append(jnp.array(np.zeros((8, 32)), dtype=jnp.bfloat16))
        layout = kv_layout([(src[0], src[1]), src[2]])
        arena = HostArena.for_layout(layout, 8)
        host = arena.allocate(8)
        with TransferEngine(layout, arena, cfg) as eng, \\
                TransferEngine(kv_layout([(dst[0], dst[1]), dst[2]]), arena, cfg) as out:
            runs = [(d, host[7 - d], 1) for d in range(8)]  # reversed: nothing coalesces
            eng.d2h(runs).result(timeout=60)
            out.h2d([(h, d, 1) for d, h, _ in runs]).result(timeout=60)
        for s, d in zip(src, dst):
            assert np.asarray(d).tobytes() == np.asarray(s).tobytes()
        print("OK")
    """)


def test_adjacent_runs_give_the_same_result_as_one_run(rig):
    rng = np.random.default_rng(4)
    pools = [make_pool("numpy", np.uint8, rng, pad=0, lead=0, dim=64)]
    _layout, arena, eng = rig([pools[0].tensor], num_host=32)
    host = arena.allocate(32)
    eng.d2h([(0, 0, 16)]).result(timeout=60)
    one = arena.memory[:16].copy()
    eng.d2h([(i, 16 + i, 1) for i in range(16)]).result(timeout=60)
    assert (arena.memory[16:32] == one).all()
    assert one.tobytes() == b"".join(pools[0].block(b) for b in range(16))
    assert sorted(host) == list(range(32))


def test_per_layer_completion(rig):
    rng = np.random.default_rng(5)
    pools = [make_pool("numpy", np.float16, rng) for _ in range(8)]
    layout, arena, eng = rig([(pools[2 * layer].tensor, pools[2 * layer + 1].tensor) for layer in range(4)])
    host = arena.allocate(16)
    fut = eng.d2h([(d, h, 1) for d, h in zip(range(16), host)])
    for layer in range(4):
        fut.wait_layer(layer, timeout=60)
        assert fut.layer_done(layer)
        for j in (2 * layer, 2 * layer + 1):  # this layer's bytes are on the host already
            assert all(host_segment(arena, layout, j, h) == pools[j].block(d) for d, h in zip(range(16), host))
    fut.result(timeout=60)
    assert fut.seconds is not None and fut.seconds >= 0
    for bad in (-1, 4, 1.0, True):
        with pytest.raises(UsageError) as ei:
            fut.wait_layer(bad)
        assert ei.value.argument == "layer"


def test_done_callback_and_repr(rig):
    rng = np.random.default_rng(6)
    p = make_pool("numpy", np.float32, rng)
    _layout, arena, eng = rig([p.tensor])
    seen, done = [], threading.Event()
    host = arena.allocate(2)
    fut = eng.d2h([(0, host[0], 1), (5, host[1], 1)])
    fut.add_done_callback(lambda f: (seen.append(f), done.set()))
    assert done.wait(60) and seen == [fut] and fut.exception() is None
    assert "d2h" in repr(fut) and "TransferEngine" in repr(eng)


def test_auto_allocate_returns_locked_blocks_that_unlock_to_evictable(rig):
    rng = np.random.default_rng(7)
    p = make_pool("numpy", np.float32, rng)
    layout, arena, eng = rig([p.tensor], num_host=8)
    fut = eng.d2h_auto_allocate([9, 2, 14])
    fut.result(timeout=60)
    hb = list(fut.host_blocks)
    assert len(set(hb)) == 3
    assert all(arena.allocator.state(b) is BlockState.LOCKED for b in hb)
    for d, h in zip([9, 2, 14], hb):
        assert host_segment(arena, layout, 0, h) == p.block(d)
    eng.unlock(hb)
    assert all(arena.allocator.state(b) is BlockState.CACHED for b in hb)
    evicted = []
    arena._on_evict = evicted.extend
    more = arena.allocate(8)  # 5 free + the 3 cached: they are evicted, oldest first
    assert evicted == sorted(hb) and set(hb) <= set(more)


def test_auto_allocate_full_arena_changes_nothing(rig):
    rng = np.random.default_rng(8)
    p = make_pool("numpy", np.float32, rng)
    _layout, arena, eng = rig([p.tensor], num_host=4)
    arena.allocate(3)
    from tiersync.errors import CapacityError

    with pytest.raises(CapacityError) as ei:
        eng.d2h_auto_allocate([0, 1])
    assert (ei.value.requested, ei.value.used, ei.value.free) == (2, 3, 1)
    a = arena.allocator
    assert (a.num_free, a.num_locked, a.num_cached) == (1, 3, 0)
    for bad, arg in (
        ([], "device_blocks"),
        ([1, 1], "device_blocks"),
        ([16], "device_blocks[0]"),
        ([-1], "device_blocks[0]"),
        ([0.5], "device_blocks"),
        (3, "device_blocks"),
        ("01", "device_blocks"),
    ):
        with pytest.raises(UsageError) as ei:
            eng.d2h_auto_allocate(bad)
        assert ei.value.argument == arg
    assert (a.num_free, a.num_locked, a.num_cached) == (1, 3, 0)


def test_closed_engine_refuses_work_and_finishes_what_was_posted(rig):
    rng = np.random.default_rng(9)
    p = make_pool("numpy", np.float32, rng)
    _layout, arena, eng = rig([p.tensor])
    host = arena.allocate(16)
    futs = [eng.d2h([(d, host[d], 1)]) for d in range(16)]
    eng.close()
    assert all(f.status is TransferStatus.DONE for f in futs)
    for call in (
        lambda: eng.d2h([(0, host[0], 1)]),
        lambda: eng.h2d([(host[0], 0, 1)]),
        lambda: eng.d2h_auto_allocate([0]),
    ):
        with pytest.raises(ClosedError):
            call()
    assert arena.allocator.num_locked == 16  # the refused auto-allocate took nothing
    eng.close()  # idempotent


def test_close_without_wait_never_leaves_a_future_hanging(rig):
    rng = np.random.default_rng(10)
    p = make_pool("numpy", np.uint8, rng, dim=512, pad=0, lead=0, num_blocks=64)
    cfg = TransferConfig(workers=1, chunk_bytes=512, max_inflight_bytes=512)
    _layout, arena, eng = rig([p.tensor], num_host=64, config=cfg)
    host = arena.allocate(64)
    futs = [eng.d2h([(d, host[63 - d], 1) for d in range(64)]) for _ in range(8)]
    eng.close(wait=False)
    for f in futs:
        exc = f.exception(timeout=60)  # done or refused, never pending forever
        assert exc is None or isinstance(exc, ClosedError)


def test_concurrent_posts_are_byte_exact(rig):
    rng = np.random.default_rng(11)
    pools = [make_pool("numpy", np.float16, rng, num_blocks=64) for _ in range(4)]
    layout, arena, eng = rig(
        [(pools[0].tensor, pools[1].tensor), (pools[2].tensor, pools[3].tensor)],
        num_host=64,
        config=TransferConfig(workers=4, chunk_bytes=2048),
    )
    arena.allocate(64)
    blocks = [p.snapshot() for p in pools]
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def client(t: int) -> None:
        try:
            mine = list(range(t * 16, t * 16 + 16))  # device blocks = host blocks of this thread
            half = len(mine) // 2
            start.wait()
            for _ in range(5):  # copy first half -> host -> second half, back and forth
                src, dst = (mine[:half], mine[half:])
                f = eng.d2h([(d, 63 - d, 1) for d in src])
                f.result(timeout=60)
                eng.h2d([(63 - s, d, 1) for s, d in zip(src, dst)]).result(timeout=60)
                for j, p in enumerate(pools):
                    for s, d in zip(src, dst):
                        assert p.block(d) == p.block(s)
                        assert host_segment(arena, layout, j, 63 - s) == p.block(s)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [] and not any(t.is_alive() for t in threads)
    for p, before in zip(pools, blocks):
        assert (p.u8[~p.live] == SENTINEL).all()
        b = np.frombuffer(before, np.uint8)
        for t in range(4):
            for d in range(t * 16, t * 16 + 8):  # sources were never overwritten
                assert p.u8[p.blocks[d]].tobytes() == b[p.blocks[d]].tobytes()


def test_posting_racing_close_either_refuses_or_completes(rig):
    rng = np.random.default_rng(12)
    p = make_pool("numpy", np.uint8, rng, dim=256, pad=0, lead=0)
    _layout, arena, eng = rig([p.tensor], config=TransferConfig(workers=2, chunk_bytes=256))
    host = arena.allocate(16)
    futs, refused = [], []
    go = threading.Barrier(5)

    def poster() -> None:
        go.wait()
        for _ in range(50):
            try:
                futs.append(eng.d2h([(d, host[d], 1) for d in range(16)]))
            except ClosedError:
                refused.append(1)

    threads = [threading.Thread(target=poster) for _ in range(4)]
    for t in threads:
        t.start()
    go.wait()
    eng.close()
    for t in threads:
        t.join(60)
    for f in futs:
        f.result(timeout=60)  # a post that was accepted is carried out
    assert len(futs) + len(refused) == 200


# -- lifecycle edges, reproduced deterministically ---------------------------
def test_post_that_loses_the_race_with_close_is_refused_not_lost(rig, monkeypatch):
    from tiersync.transfer import engine as engine_mod

    rng = np.random.default_rng(13)
    p = make_pool("numpy", np.float32, rng)
    _layout, arena, eng = rig([p.tensor])
    host = arena.allocate(1)
    inside, resume = threading.Event(), threading.Event()
    real = engine_mod.block_copy

    def slow_block_copy(*a, **kw):  # holds the poster after its open check, before it enqueues
        inside.set()
        assert resume.wait(30)
        return real(*a, **kw)

    monkeypatch.setattr(engine_mod, "block_copy", slow_block_copy)
    outcome: list[object] = []

    def poster() -> None:
        try:
            outcome.append(eng.d2h([(0, host[0], 1)]))
        except ClosedError as exc:
            outcome.append(exc)

    t = threading.Thread(target=poster)
    t.start()
    assert inside.wait(30)
    eng.close()  # the dispatcher has stopped: work queued now would never run
    resume.set()
    t.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], ClosedError)


def test_copy_pool_refusing_work_fails_the_future_not_the_dispatcher(rig):
    rng = np.random.default_rng(14)
    p = make_pool("numpy", np.float32, rng)
    _layout, arena, eng = rig([p.tensor])
    host = arena.allocate(2)
    eng._pool.shutdown(wait=True)  # what close(wait=False) does under a dispatcher still admitting chunks
    fut = eng.d2h([(0, host[0], 1)])
    assert isinstance(fut.exception(timeout=30), ClosedError)
    fut2 = eng.d2h([(1, host[1], 1)])  # the dispatcher is still alive and answers
    assert isinstance(fut2.exception(timeout=30), ClosedError)
    assert eng._pacer.inflight == 0


def test_auto_allocate_failing_after_allocation_frees_its_blocks(rig, monkeypatch):
    from tiersync.transfer import engine as engine_mod

    rng = np.random.default_rng(15)
    p = make_pool("numpy", np.float32, rng)
    _layout, arena, eng = rig([p.tensor], num_host=4)

    def boom(*a, **kw):
        raise RuntimeError("injected")

    monkeypatch.setattr(engine_mod, "block_copy", boom)
    with pytest.raises(RuntimeError, match="injected"):
        eng.d2h_auto_allocate([0, 1])
    a = arena.allocator
    assert (a.num_free, a.num_locked, a.num_cached) == (4, 0, 0)


def test_closed_arena_is_refused_before_any_copy(rig):
    rng = np.random.default_rng(16)
    p = make_pool("numpy", np.float32, rng)
    _layout, arena, eng = rig([p.tensor])
    host = arena.allocate(1)
    before = p.snapshot()
    arena.close()
    for call in (lambda: eng.d2h([(0, host[0], 1)]), lambda: eng.h2d([(host[0], 0, 1)])):
        with pytest.raises(ClosedError):
            call()
    assert p.snapshot() == before
