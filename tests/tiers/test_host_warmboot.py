"""Warm boot through the whole save path: engine d2h into a /dev/shm arena, publish, SIGKILL.

Invariant: after any number of kills at random moments, every block the arena recovers
holds exactly the bytes that were saved under its key, and the most recently acknowledged
saves (fewer than the arena holds, so LRU cannot have evicted them) are all recovered.
"""

from __future__ import annotations

import os
import random
import signal
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tiersync.layout import kv_layout
from tiersync.tiers.host import HostArena
from tiersync.tiers.shm import ShmConfig

NUM_DEVICE, HOST_BLOCKS, LAYERS = 8, 24, 3


def content(device_block: int, rnd: int, shape: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng(device_block * 1_000_003 + rnd)
    return rng.integers(0, 255, size=shape, dtype=np.uint8)


def make_layout() -> tuple[kv_layout, list[np.ndarray]]:
    pools = [np.zeros((NUM_DEVICE, 4, 1024), np.uint8) for _ in range(LAYERS)]
    return kv_layout(pools), pools


CHILD = textwrap.dedent("""
    import struct, sys
    sys.path.insert(0, {testdir!r})
    from test_host_warmboot import content, make_layout
    from tiersync.tiers.host import HostArena
    from tiersync.tiers.shm import ShmConfig
    from tiersync.transfer import TransferEngine
    layout, pools = make_layout()
    arena = HostArena.for_layout(layout, {host}, shm=ShmConfig(key="wb", model_id="m1", directory={dir!r}))
    engine = TransferEngine(layout, arena)
    rnd = {start}
    print("READY", flush=True)
    while True:
        rnd += 1
        d = rnd % {ndev}
        for p in pools:
            p[d] = content(d, rnd, p[d].shape)
        [h] = arena.allocate(1)
        engine.d2h([(d, h, 1)]).result()
        key = struct.pack("<qq", d, rnd)
        arena.publish([h], [key])
        arena.allocator.unlock([h])
        print("ACK", d, rnd, flush=True)
""")


def check_recovered(arena: HostArena, layout, pools, acked: list[tuple[int, int]]) -> None:
    found = {}
    for r in arena.recovered:
        d, rnd = struct.unpack("<qq", r.key)
        for layer, (p, off) in enumerate(zip(pools, layout.host_offsets)):
            want = content(d, rnd, p[d].shape).reshape(-1)
            got = arena.memory[r.block, off : off + want.size]
            assert np.array_equal(got, want), f"block {r.block} key {(d, rnd)} layer {layer}: wrong bytes"
        found[(d, rnd)] = r.block
    recent = acked[-(HOST_BLOCKS - 2) :]
    missing = [k for k in recent if k not in found]
    assert not missing, f"acknowledged saves lost: {missing}"


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this machine")
def test_sigkill_during_saves_recovers_every_acknowledged_block(tmp_path):
    rng = random.Random(7)
    layout, pools = make_layout()
    acked: list[tuple[int, int]] = []
    testdir = os.path.dirname(__file__)
    for life in range(16):
        code = CHILD.format(testdir=testdir, host=HOST_BLOCKS, dir=str(tmp_path), start=life * 10_000, ndev=NUM_DEVICE)
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "READY"
        for _ in range(rng.randint(0, 12)):
            _, d, rnd = child.stdout.readline().split()
            acked.append((int(d), int(rnd)))
        os.kill(child.pid, signal.SIGKILL)  # mid-save: the child never stops between saves
        child.wait()
        # The child runs ahead of our reads: every ACK it printed before dying counts
        # (else its unread saves evict "recent" acknowledged ones and the check races).
        for line in child.stdout.read().splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == "ACK":
                acked.append((int(parts[1]), int(parts[2])))
        child.stdout.close()
        arena = HostArena.for_layout(
            layout, HOST_BLOCKS, shm=ShmConfig(key="wb", model_id="m1", directory=str(tmp_path))
        )
        try:
            check_recovered(arena, layout, pools, acked)
        finally:
            arena.close()
    other = HostArena.for_layout(layout, HOST_BLOCKS, shm=ShmConfig(key="wb", model_id="m2", directory=str(tmp_path)))
    try:
        assert other.recovered == [] and other.allocator.num_free == HOST_BLOCKS
    finally:
        other.close()


def test_recovered_blocks_are_evictable_and_reloadable(tmp_path):
    layout, pools = make_layout()
    from tiersync.transfer import TransferEngine

    cfg = ShmConfig(key="re", model_id="m1", directory=str(tmp_path))
    with HostArena.for_layout(layout, HOST_BLOCKS, shm=cfg) as arena, TransferEngine(layout, arena) as engine:
        for p in pools:
            p[2] = content(2, 1, p[2].shape)
        [h] = arena.allocate(1)
        engine.d2h([(2, h, 1)]).result()
        arena.publish([h], [b"k2"])
        arena.allocator.unlock([h])
    for p in pools:
        p[:] = 0
    with HostArena.for_layout(layout, HOST_BLOCKS, shm=cfg) as arena:
        [rec] = arena.recovered
        assert rec.key == b"k2" and arena.allocator.num_cached == 1
        with TransferEngine(layout, arena) as engine:
            arena.allocator.lock([rec.block])
            engine.h2d([(rec.block, 5, 1)]).result()
        for p in pools:
            assert np.array_equal(p[5], content(2, 1, p[5].shape))


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this machine")
def test_an_entry_vouching_for_part_of_a_block_is_not_adopted(tmp_path):
    """Another writer of the segment may publish an entry whose checksum covers only the first
    bytes of a block; adopting it would serve the rest of the block unchecked."""
    from tiersync.tiers.shm import Geometry, ShmSegment

    layout, _ = make_layout()
    cfg = ShmConfig(key="part", model_id="m1", directory=str(tmp_path))
    with HostArena.for_layout(layout, HOST_BLOCKS, shm=cfg) as arena:
        [whole, part] = arena.allocate(2)
        arena.memory[whole] = 7
        arena.publish([whole], [b"whole"])
        config = arena.config
    seg = ShmSegment.open(cfg, Geometry(config.num_blocks, config.block_nbytes, config.layout_digest))
    try:
        seg.payload[part * config.block_nbytes : (part + 1) * config.block_nbytes] = b"\xee" * config.block_nbytes
        seg.publish(part, b"part", nbytes=100)  # valid: its checksum covers 100 bytes
        assert {r.key for r in seg.recover()} >= {b"whole", b"part"}
    finally:
        seg.close()
    with HostArena.for_layout(layout, HOST_BLOCKS, shm=cfg) as arena:
        assert [r.key for r in arena.recovered] == [b"whole"] and arena.allocator.num_cached == 1
        assert arena.allocator.num_free == config.num_blocks - 1  # the partial block is free again
