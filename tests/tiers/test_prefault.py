"""Background pre-faulting of the anonymous host arena (tiersync.tiers.prefault)."""

from __future__ import annotations

import pytest

from tiersync.errors import UsageError
from tiersync.tiers.host import HostArena, HostArenaConfig


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_new_arena_is_populated_in_the_background_without_changing_a_byte():
    before = _rss_bytes()
    arena = HostArena(HostArenaConfig(num_blocks=64, block_nbytes=1 << 20))  # 64 MiB, no page touched yet
    try:
        arena.memory[3] = 7  # a write racing the population keeps its bytes
        assert arena.prefault.done.wait(30)
        if arena.prefault.populated == arena.config.nbytes:  # the kernel has MADV_POPULATE_WRITE
            assert _rss_bytes() - before >= 60 << 20
        assert (arena.memory[3] == 7).all() and not arena.memory[4:].any()
    finally:
        arena.close()


def test_closing_stops_the_population_at_once():
    arena = HostArena(HostArenaConfig(num_blocks=512, block_nbytes=1 << 20))
    arena.close()
    assert arena.prefault.done.is_set() and arena.prefault.populated <= arena.config.nbytes


def test_prefault_can_be_turned_off_and_is_validated():
    arena = HostArena(HostArenaConfig(num_blocks=4, block_nbytes=4096, prefault=False))
    try:
        assert arena.prefault is None
    finally:
        arena.close()
    with pytest.raises(UsageError) as ei:
        HostArenaConfig(num_blocks=4, block_nbytes=4096, prefault="yes")
    assert ei.value.argument == "HostArenaConfig.prefault"
