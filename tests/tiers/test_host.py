"""The anonymous-memory host arena (tiersync.tiers.host); shm backing is tested in test_shm.py."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from tiersync.errors import CapacityError, ClosedError, UsageError
from tiersync.layout.adapters import kv_layout
from tiersync.tiers.allocator import BlockState
from tiersync.tiers.eviction import LRUPolicy, S3FIFOPolicy
from tiersync.tiers.host import HostArena, HostArenaConfig


@pytest.fixture
def arena():
    a = HostArena(HostArenaConfig(num_blocks=8, block_nbytes=4096))
    yield a
    a.close()


@pytest.mark.parametrize(
    "kw, argument",
    [
        (dict(num_blocks=0), "HostArenaConfig.num_blocks"),
        (dict(num_blocks=-1), "HostArenaConfig.num_blocks"),
        (dict(num_blocks=2.0), "HostArenaConfig.num_blocks"),
        (dict(num_blocks=True), "HostArenaConfig.num_blocks"),
        (dict(block_nbytes=0), "HostArenaConfig.block_nbytes"),
        (dict(block_nbytes="4096"), "HostArenaConfig.block_nbytes"),
        (dict(policy="mru"), "HostArenaConfig.policy"),
        (dict(layout_digest=b"short"), "HostArenaConfig.layout_digest"),
        (dict(layout_digest="0" * 16), "HostArenaConfig.layout_digest"),
        (dict(shareable=1), "HostArenaConfig.shareable"),
        (dict(prefault="yes"), "HostArenaConfig.prefault"),
    ],
)
def test_config_rejects_bad_values(kw, argument):
    args = dict(num_blocks=4, block_nbytes=64)
    args.update(kw)
    with pytest.raises(UsageError) as ei:
        HostArenaConfig(**args)
    assert ei.value.argument == argument


def test_for_layout_refuses_a_non_layout_and_an_arena_beyond_memory_clearly():
    with pytest.raises(UsageError) as ei:
        HostArena.for_layout([1, 2], 16)
    assert ei.value.argument == "layout"
    config = HostArenaConfig(num_blocks=10**9, block_nbytes=1 << 20)  # 1 PB: no machine maps it
    with pytest.raises(CapacityError, match="num_blocks"):
        HostArena(config)


def test_config_nbytes_and_arena_type_check():
    assert HostArenaConfig(num_blocks=3, block_nbytes=100).nbytes == 300
    with pytest.raises(UsageError) as ei:
        HostArena({"num_blocks": 3})
    assert ei.value.argument == "config"


def test_memory_is_page_aligned_zeroed_and_block_shaped(arena):
    assert arena.memory.shape == (8, 4096) and arena.memory.dtype == np.uint8
    assert arena.address % mmap.PAGESIZE == 0
    assert not arena.memory.any()
    assert not arena.persistent and arena.num_blocks == 8 and arena.block_nbytes == 4096
    assert "anonymous" in repr(arena) and "free=8" in repr(arena)


def test_block_views_are_writable_and_bounded(arena):
    v = arena.block(3)
    assert len(v) == 4096
    v[:4] = b"abcd"
    assert arena.memory[3, :4].tobytes() == b"abcd" and not arena.memory[2].any()
    assert len(arena.block(np.int64(7))) == 4096
    for bad in (-1, 8, 1.0):
        with pytest.raises(UsageError) as ei:
            arena.block(bad)
        assert ei.value.argument == "b"


def test_allocate_publish_free_lifecycle(arena):
    blocks = arena.allocate(3)
    assert blocks == [0, 1, 2] and arena.used_nbytes == 3 * 4096
    arena.publish(blocks, [b"k0", b"k1", b"k2"])
    assert [arena.key_of(b) for b in blocks] == [b"k0", b"k1", b"k2"] and arena.key_of(5) is None
    arena.free([1])
    assert arena.key_of(1) is None and arena.allocator.state(1) is BlockState.FREE
    assert arena.used_nbytes == 2 * 4096


def test_reallocating_an_evicted_block_withdraws_its_key():
    evicted = []
    with HostArena(HostArenaConfig(num_blocks=2, block_nbytes=64), on_evict=evicted.extend) as a:
        b = a.allocate(2)
        a.publish(b, [b"x", b"y"])
        a.allocator.unlock([b[1]])
        a.allocator.unlock([b[0]])  # b[1] is now the least recently used
        assert a.key_of(b[0]) == b"x"  # cached blocks keep their key
        got = a.allocate(1)
        assert got == [b[1]] and evicted == [b[1]]
        assert a.key_of(b[1]) is None and a.key_of(b[0]) == b"x"
        with pytest.raises(CapacityError):
            a.allocate(2)
        assert a.key_of(b[0]) == b"x" and evicted == [b[1]]


def test_publish_refusals_change_nothing(arena):
    blocks = arena.allocate(2)
    arena.publish([blocks[0]], [b"old"])
    arena.allocator.unlock([blocks[1]])  # cached: not locked
    cases = [
        (([blocks[0]], [b"a", b"b"]), "keys"),
        (([blocks[0]], [b""]), "keys"),
        (([blocks[0]], [b"x" * 33]), "keys"),
        (([blocks[0]], ["str"]), "keys"),
        (([blocks[1]], [b"k"]), "blocks"),  # cached
        (([5], [b"k"]), "blocks"),  # free
        (([-1], [b"k"]), "blocks"),  # not a block id
        (([8], [b"k"]), "blocks"),
    ]
    for args, argument in cases:
        with pytest.raises(UsageError) as ei:
            arena.publish(*args)
        assert ei.value.argument == argument, args
        assert {b: arena.key_of(b) for b in range(8)} == {**dict.fromkeys(range(8)), blocks[0]: b"old"}
    assert arena.key_of(-1) is None


@pytest.mark.parametrize("policy, cls", [("lru", LRUPolicy), ("s3fifo", S3FIFOPolicy)])
def test_for_layout_mirrors_the_layout(policy, cls):
    layout = kv_layout([(np.zeros((4, 3, 10), np.float16), np.zeros((4, 3, 10), np.float16))])
    with HostArena.for_layout(layout, 5, policy=policy) as a:
        assert a.block_nbytes == layout.host_block_nbytes == 128
        assert a.config.layout_digest == layout.digest() and a.num_blocks == 5
        assert isinstance(a.allocator._policy, cls)


def test_close_is_idempotent_and_refuses_further_use():
    a = HostArena(HostArenaConfig(num_blocks=2, block_nbytes=64))
    b = a.allocate(1)
    a.close()
    a.close()
    for call in (lambda: a.allocate(1), lambda: a.block(0), lambda: a.free(b), lambda: a.publish(b, [b"k"])):
        with pytest.raises(ClosedError):
            call()


def test_close_with_a_view_still_exported_does_not_raise():
    a = HostArena(HostArenaConfig(num_blocks=2, block_nbytes=64))
    view = a.block(0)
    a.close()
    view[0] = 7  # the mapping lives as long as the view
    assert view[0] == 7


def test_publish_refuses_negative_ids_even_when_the_last_block_is_locked():
    with HostArena(HostArenaConfig(num_blocks=2, block_nbytes=64)) as a:
        a.allocate(2)
        with pytest.raises(UsageError) as ei:
            a.publish([-1], [b"k"])
        assert ei.value.argument == "blocks"
        assert a.key_of(-1) is None and a.key_of(1) is None


def test_a_shareable_arena_is_a_sealed_memfd_another_map_sees_and_closing_releases_it(tmp_path):
    """``shareable``: the memory is a memfd sealed against shrinking and growing (a reader's map
    can never fault), ``shared`` names it, another map of it sees every write, and close
    closes the descriptor. A warm-boot arena cannot also be shareable."""
    import fcntl
    import os

    from tiersync.tiers.shareable import SEALS
    from tiersync.tiers.shm import ShmConfig

    a = HostArena(HostArenaConfig(num_blocks=4, block_nbytes=8192, shareable=True))
    region = a.shared
    assert region is not None and (region.address, region.nbytes) == (a.address, 4 * 8192)
    assert fcntl.fcntl(region.fd, fcntl.F_GET_SEALS) & SEALS == SEALS
    with pytest.raises(OSError):
        os.ftruncate(region.fd, 4096)  # sealed: it cannot shrink under a reader
    [b] = a.allocate(1)
    a.block(b)[:] = np.random.default_rng(1).bytes(8192)
    fd = os.open(f"/proc/self/fd/{region.fd}", os.O_RDONLY)
    other = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    os.close(fd)
    if fcntl.fcntl(region.fd, fcntl.F_GET_SEALS) & 0x10:  # F_SEAL_FUTURE_WRITE (Linux 5.1+)
        rw = os.open(f"/proc/self/fd/{region.fd}", os.O_RDWR)
        with pytest.raises(OSError):
            os.write(rw, b"x")  # nobody but the owner writes into the arena
        with pytest.raises(OSError):
            mmap.mmap(rw, 0, flags=mmap.MAP_SHARED)
        os.close(rw)
    assert other[b * 8192 : (b + 1) * 8192] == bytes(a.block(b))
    assert region.covers(a.address, a.address + 4 * 8192) and not region.covers(a.address, a.address + 4 * 8192 + 1)
    a.close()
    assert a.shared is None  # names nothing once closed
    with pytest.raises(OSError):
        os.fstat(region.fd)
    other.close()
    with HostArena(HostArenaConfig(num_blocks=1, block_nbytes=64)) as private:
        assert private.shared is None
    shm = ShmConfig(key="k", model_id="m", directory=str(tmp_path))
    with pytest.raises(UsageError) as ei:
        HostArenaConfig(num_blocks=1, block_nbytes=64, shm=shm, shareable=True)
    assert ei.value.argument == "HostArenaConfig.shareable"
