"""Registry lookup benchmark: batches of 256 keys against the embedded backend (or gRPC)."""

from __future__ import annotations

import os
import random
import statistics
import time

from tiersync.net.registry.base import Registry, StoreInfo
from tiersync.net.registry.memory import MemoryRegistry


def _populate(registry: Registry, n_keys: int, n_stores: int) -> list[bytes]:
    keys = [os.urandom(16) for _ in range(n_keys)]
    for i in range(n_stores):
        registry.register_store(StoreInfo(f"store-{i}", f"127.0.0.1:{7000 + i}", 1000, f"g{i % 2}"))
        registry.publish(f"store-{i}", keys[i::n_stores])
    return keys


def _time_batches(registry: Registry, keys: list[bytes], batches: int, batch_size: int) -> list[float]:
    rng = random.Random(0)
    misses = [os.urandom(16) for _ in range(batch_size // 4)]
    latencies = []
    for _ in range(batches):
        batch = rng.sample(keys, batch_size - len(misses)) + misses  # 75% hits
        start = time.perf_counter()
        registry.lookup(batch)
        latencies.append(time.perf_counter() - start)
    return latencies


def bench_registry(
    n_keys: int = 50_000, batches: int = 400, batch_size: int = 256, n_stores: int = 8, via_grpc: bool = False
) -> dict[str, float]:
    """Time ``batches`` lookups of ``batch_size`` keys; returns {lookups_per_s, p50_ms, p99_ms}.

    ``via_grpc``: serve the embedded backend on 127.0.0.1 and look up through a
    :class:`~tiersync.net.registry.grpc_service.RegistryClient` instead.
    """
    backend = MemoryRegistry()
    keys = _populate(backend, n_keys, n_stores)
    server = client = None
    registry: Registry = backend
    if via_grpc:
        from tiersync.net.registry.grpc_service import RegistryClient, serve_registry

        server = serve_registry(backend)
        registry = client = RegistryClient(server.address)
    try:
        _time_batches(registry, keys, max(1, batches // 10), batch_size)  # warm-up
        lat = sorted(_time_batches(registry, keys, batches, batch_size))
    finally:
        if client is not None:
            client.close()
        if server is not None:
            server.stop()
    return {
        "lookups_per_s": batch_size * len(lat) / sum(lat),
        "p50_ms": statistics.median(lat) * 1e3,
        "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3,
    }
