"""Registry restart: kill the registry (the `tiersync registry` process and/or its Redis), restart it.

During the outage lookups come back shorter (never an exception) and a serving
host's read-back fills nothing; after the restart the store node re-registers
through its heartbeat and lookups (and the read-back) are full again.
"""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from _peer import TOKEN, RedisProc, RegistryProc, StoreNodeProc, wait_until
from tiersync.layout.adapters import kv_layout
from tiersync.net.registry.base import RegistryConfig, StoreInfo
from tiersync.net.registry.grpc_service import RegistryClient
from tiersync.net.sweep import RemoteTier, SweepConfig
from tiersync.store import KVCacheStore, Residency, StoreConfig

BLOCK = 1024
FAST = RegistryConfig(rpc_timeout_s=0.5)
needs_redis = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not on PATH")


class Cluster:
    """A registry (memory or Redis backed) process, one store node heartbeating every 0.2 s."""

    def __init__(self, backend: str, workdir: str) -> None:
        self.redis = RedisProc(workdir) if backend != "memory" else None
        self.registry = RegistryProc(redis=self.redis.url if self.redis else None, store_ttl_s=2.0)
        self.node = StoreNodeProc(f"{64 * BLOCK}", block=BLOCK, registry=self.registry.address, heartbeat_s=0.2)
        self.client = RegistryClient(self.registry.address, FAST)

    def kill(self, what: str) -> None:
        if what in ("registry", "both"):
            self.registry.kill()
        if what in ("redis", "both"):
            self.redis.kill()

    def restart(self, what: str, workdir: str) -> None:
        if what in ("redis", "both"):
            self.redis = RedisProc(workdir, port=self.redis.port)  # empty: no persistence
        if what in ("registry", "both"):
            self.registry = RegistryProc(
                self.registry.port, redis=self.redis.url if self.redis else None, store_ttl_s=2.0
            )

    def close(self) -> None:
        self.client.close()
        for proc in (self.node, self.registry, self.redis):
            if proc is not None:
                proc.kill()


@pytest.mark.parametrize(
    "backend, kill",
    [
        ("memory", "registry"),
        pytest.param("redis", "redis", marks=needs_redis),
        pytest.param("redis", "both", marks=needs_redis),
    ],
)
def test_registry_restart_shortens_lookups_then_nodes_reregister(backend, kill, tmp_path):
    cluster = Cluster(backend, str(tmp_path))
    dev = np.random.default_rng(3).integers(0, 256, (200, BLOCK), dtype=np.uint8)
    ref = dev.copy()
    store = KVCacheStore(kv_layout([dev]), StoreConfig(host_blocks=200))  # sweep: 0 free -> 10
    keys = [b"r" + i.to_bytes(15, "little") for i in range(200)]
    tier = RemoteTier(store, cluster.client, SweepConfig(token=TOKEN.encode(), timeout_s=5.0))
    try:
        store.save(list(range(200)), keys).result(60)
        assert tier.sweep().remote == {cluster.node.store_id: 10}
        assert cluster.client.lookup(keys[:10]) == [(cluster.node.store_id,)] * 10
        cluster.kill(kill)
        assert cluster.client.lookup(keys[:10]) == [()] * 10  # shorter answer, no exception
        assert cluster.client.placement_targets("", 4) == []
        assert tier.fill(keys) == 0 and set(store.residency(keys[:10])) == {Residency.REMOTE}
        cluster.restart(kill, str(tmp_path))
        full = [(cluster.node.store_id,)] * 10
        assert wait_until(lambda: cluster.client.lookup(keys[:10]) == full, timeout=20)
        assert [s.store_id for s in cluster.client.placement_targets("", 4)] == [cluster.node.store_id]
        assert tier.fill(keys) == 10
        hit = store.lookup(keys)
        assert hit.complete
        dev[:10] = 0
        store.load(keys[:10], list(range(10))).result(60)
        store.release(hit.keys[10:])
        assert np.array_equal(dev[:10], ref[:10])
    finally:
        store.close()
        cluster.close()


@needs_redis
def test_direct_redis_backend_outage_shortens_lookups(tmp_path):
    from tiersync.net.registry.redis_backend import RedisRegistry

    redis = RedisProc(str(tmp_path))
    reg = RedisRegistry(redis.url, FAST)
    try:
        reg.register_store(StoreInfo("a", "127.0.0.1:1", 5, capacity_blocks=9))
        reg.publish("a", [b"k" * 16])
        assert reg.lookup([b"k" * 16]) == [("a",)] and reg.get_store("a").capacity_blocks == 9
        redis.kill()
        assert reg.lookup([b"k" * 16, b"j" * 16]) == [(), ()] and reg.placement_targets("", 2) == []
        assert reg.failures == 2
    finally:
        reg.close()
        redis.kill()


@needs_redis
@pytest.mark.parametrize("password", [None, "s3cret-in-the-url"])
def test_registry_process_says_when_redis_goes_and_comes_back(tmp_path, password):
    """An unreachable Redis is logged by the registry (once, at WARNING), and so is its return;
    the registry keeps serving meanwhile. A password in the Redis URL never reaches the log."""
    redis = RedisProc(str(tmp_path), password=password)
    registry = RegistryProc(redis=redis.url, store_ttl_s=1.0)  # health checked every second
    try:
        assert "unreachable" not in "".join(registry.tail)
        redis.kill()
        registry.wait_for(f"redis at {redis.shown} is unreachable", 30)
        with pytest.raises(subprocess.TimeoutExpired):  # its sweeps fail meanwhile: logged, never fatal
            registry.proc.wait(2.5)
        registry.wait_for("registry sweep failed", 10)
        redis = RedisProc(str(tmp_path), port=redis.port, password=password)
        registry.wait_for(f"redis at {redis.shown} is reachable again", 30)
        assert "".join(registry.tail).count("is unreachable") == 1
        assert password is None or password not in "".join(registry.tail)
    finally:
        registry.kill()
        redis.kill()
