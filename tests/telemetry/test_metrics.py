"""Library metrics on prometheus_client's default registry, with Prometheus-style names: the
transfer engine's seconds histogram and bytes counter, the host arenas' allocated bytes, and
every KV cache store's counters under its own ``store`` label, gone when the store closes."""

from __future__ import annotations

import numpy as np
from prometheus_client import REGISTRY, generate_latest

from tiersync.layout.adapters import kv_layout
from tiersync.store import KVCacheStore, StoreConfig
from tiersync.telemetry.metrics import Metrics
from tiersync.tiers.host import HostArena, HostArenaConfig


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_transfers_are_recorded_in_seconds_on_the_default_registry():
    Metrics.default()
    pool = np.arange(8 * 4096, dtype=np.uint8).reshape(8, 4096)
    before = (
        _sample("tiersync_transfer_seconds_count", direction="d2h"),
        _sample("tiersync_transferred_bytes_total", direction="d2h"),
    )
    with KVCacheStore(kv_layout([pool]), StoreConfig(host_blocks=8)) as store:
        store.save([0, 1, 2], [bytes([i]) * 16 for i in range(3)]).result(30)
        assert _sample("tiersync_transfer_seconds_count", direction="d2h") > before[0]
        assert _sample("tiersync_transferred_bytes_total", direction="d2h") >= before[1] + 3 * 4096
        assert _sample("tiersync_store_bytes_total", store=store.metrics.store, tier="host", direction="in") == 3 * 4096
    text = generate_latest(REGISTRY).decode()
    assert "# TYPE tiersync_transfer_seconds histogram" in text and "_ms" not in text.replace("tiersync_", "")


def test_every_store_has_its_own_series_and_loses_them_when_closed():
    pool = np.zeros((8, 1024), np.uint8)
    a = KVCacheStore(kv_layout([pool]), StoreConfig(host_blocks=8))
    b = KVCacheStore(kv_layout([pool]), StoreConfig(host_blocks=8))
    try:
        assert a.metrics.store != b.metrics.store
        a.lookup([b"x" * 16, b"y" * 16])  # two misses in a, none in b
        assert _sample("tiersync_store_misses_total", store=a.metrics.store) == 2
        assert (
            a.metrics.value("tiersync_store_misses_total") == 2 and b.metrics.value("tiersync_store_misses_total") == 0
        )
    finally:
        b.close()
        a.close()
    assert REGISTRY.get_sample_value("tiersync_store_misses_total", {"store": a.metrics.store}) is None


def test_allocated_bytes_gauge_follows_open_arenas():
    Metrics.default()
    base = _sample("tiersync_buffer_allocated_bytes")
    arena = HostArena(HostArenaConfig(num_blocks=4, block_nbytes=4096, prefault=False))
    try:
        blocks = arena.allocator.allocate(3)
        assert _sample("tiersync_buffer_allocated_bytes") == base + 3 * 4096
        arena.free(blocks)
        assert _sample("tiersync_buffer_allocated_bytes") == base
        arena.allocator.allocate(2)
    finally:
        arena.close()
    assert _sample("tiersync_buffer_allocated_bytes") == base  # a closed arena holds nothing
