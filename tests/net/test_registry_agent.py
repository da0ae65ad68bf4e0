"""Store nodes in the registry: register, heartbeat, advertise held keys; TTL expiry; outages.

In-process cases drive an injected clock (no sleeps); the process cases run a
real `tiersync store-node --registry` against an in-process gRPC registry with a
short store TTL and wait on conditions.
"""

from __future__ import annotations

import shutil
import signal
import threading

import pytest

from _peer import TOKEN, RedisProc, StoreNodeProc, wait_until
from tiersync.errors import UsageError
from tiersync.net.registry.agent import AgentConfig, StoreAgent
from tiersync.net.registry.base import Registry, RegistryConfig
from tiersync.net.registry.errors import RegistryUnavailableError
from tiersync.net.registry.memory import MemoryRegistry
from tiersync.net.store_client import StoreNodeClient

CFG = RegistryConfig(heartbeat_interval_s=10, store_ttl_s=30, block_ttl_s=100)
KEYS = [bytes([7]) + i.to_bytes(15, "little") for i in range(6)]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Flaky(Registry):
    """Forwards to ``inner``; while ``down`` every call raises RegistryUnavailableError."""

    def __init__(self, inner: Registry) -> None:
        self.inner, self.down = inner, False

    def _up(self) -> Registry:
        if self.down:
            raise RegistryUnavailableError("registry down", peer="test")
        return self.inner

    def register_store(self, info):
        return self._up().register_store(info)

    def heartbeat(self, store_id, free_blocks):
        return self._up().heartbeat(store_id, free_blocks)

    def remove_store(self, store_id):
        return self._up().remove_store(store_id)

    def get_store(self, store_id):
        return self._up().get_store(store_id)

    def publish(self, store_id, keys):
        return self._up().publish(store_id, keys)

    def unpublish(self, store_id, keys):
        return self._up().unpublish(store_id, keys)

    def lookup(self, keys):
        return self._up().lookup(keys)

    def placement_targets(self, pool_group, count, exclude=()):
        return self._up().placement_targets(pool_group, count, exclude)


def _agent(registry: Registry, held: list[bytes], clock: Clock, free: list[int]) -> StoreAgent:
    cfg = AgentConfig("s1", "127.0.0.1:7001", "g", heartbeat_interval_s=300, republish_interval_s=50)
    return StoreAgent(
        registry, cfg, free_blocks=lambda: free[0], held_keys=lambda: list(held), capacity_blocks=64, clock=clock
    )


def test_register_advertise_heartbeat_and_expire_without_heartbeats():
    clock, held, free = Clock(), KEYS[:3], [60]
    reg = MemoryRegistry(CFG, clock)
    agent = _agent(reg, held, clock, free)
    agent.start()  # registers and publishes at once; the thread's first beat is 300 s away
    try:
        info = reg.get_store("s1")
        assert (info.address, info.free_blocks, info.capacity_blocks, info.pool_group) == (
            "127.0.0.1:7001",
            60,
            64,
            "g",
        )
        assert reg.lookup(KEYS[:4]) == [("s1",)] * 3 + [()]
        held.extend(KEYS[3:5])
        agent.announce(KEYS[3:5])  # newly stored: published at once
        assert reg.lookup(KEYS[3:5]) == [("s1",)] * 2
        free[0] = 10
        clock.now += 20
        assert agent.beat() and reg.get_store("s1").free_blocks == 10 and agent.registrations == 1
        clock.now += 31  # no heartbeat for longer than the store TTL: gone from placement and lookups
        assert reg.placement_targets("g", 5) == [] and reg.lookup(KEYS[:1]) == [()]
        assert agent.beat() and agent.registrations == 2  # heartbeat refused -> re-register + re-publish
        assert [s.store_id for s in reg.placement_targets("g", 5)] == ["s1"]
        assert reg.lookup(KEYS[:5]) == [("s1",)] * 5
    finally:
        agent.close()
    assert reg.get_store("s1") is None  # close() removes the store


def test_outage_defers_announcements_and_a_later_beat_republishes_everything():
    clock, held, free = Clock(), KEYS[:2], [5]
    inner = MemoryRegistry(CFG, clock)
    reg = Flaky(inner)
    agent = _agent(reg, held, clock, free)
    agent.beat()
    reg.down = True
    held.append(KEYS[2])
    agent.announce([KEYS[2]])  # never raises; deferred
    assert agent.beat() is False
    reg.down = False
    assert inner.lookup([KEYS[2]]) == [()]
    assert agent.beat() and agent.registrations == 2
    assert inner.lookup(KEYS[:3]) == [("s1",)] * 3
    for _ in range(5):  # beats every 20 s; at 60 s (> republish_interval_s 50) a full re-publish
        clock.now += 20
        assert agent.beat()
    assert agent.registrations == 3
    clock.now += 10  # 110 s after the first publish (> block TTL 100): alive only thanks to the refresh
    assert inner.lookup(KEYS[:3]) == [("s1",)] * 3


def test_agent_config_is_validated():
    with pytest.raises(UsageError):
        AgentConfig("", "127.0.0.1:1")
    with pytest.raises(UsageError):
        AgentConfig("s", "127.0.0.1:1", heartbeat_interval_s=0)


@pytest.fixture
def grpc_registry():
    from tiersync.net.registry.grpc_service import RegistryClient, serve_registry

    backend = MemoryRegistry(RegistryConfig(heartbeat_interval_s=0.2, store_ttl_s=1.0))
    server = serve_registry(backend)
    client = RegistryClient(server.address)
    yield server.address, client
    client.close()
    server.stop()


def test_store_node_process_registers_advertises_and_expires_when_it_stops(grpc_registry):
    address, reg = grpc_registry
    node = StoreNodeProc("1MiB", block=4096, registry=address, heartbeat_s=0.2, store_id="node-a")
    try:
        info = reg.get_store("node-a")
        assert info is not None and info.address == node.address and info.capacity_blocks == 256
        StoreNodeClient(node.address, token=TOKEN.encode(), timeout=10).offer_and_push(KEYS[:4], [b"x" * 4096] * 4)
        assert reg.lookup(KEYS[:4]) == [("node-a",)] * 4  # advertised before COMMITTED was answered
        assert wait_until(lambda: reg.get_store("node-a").free_blocks == 252)  # heartbeats carry the count
        node.signal(signal.SIGSTOP)  # no more heartbeats
        assert wait_until(lambda: reg.placement_targets("", 5) == [] and reg.lookup(KEYS[:1]) == [()])
        node.signal(signal.SIGCONT)  # its next heartbeat is refused: it re-registers and re-publishes
        assert wait_until(lambda: reg.lookup(KEYS[:4]) == [("node-a",)] * 4)
        assert [s.store_id for s in reg.placement_targets("", 5)] == ["node-a"]
        node.signal(signal.SIGTERM)  # a clean stop removes it from the registry
        assert node.proc.wait(15) == 0 and reg.get_store("node-a") is None
    finally:
        node.kill()


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not on PATH")
def test_store_node_process_registers_directly_in_redis(tmp_path):
    from tiersync.net.registry.redis_backend import RedisRegistry

    redis = RedisProc(str(tmp_path))
    node = None
    reg = RedisRegistry(redis.url, RegistryConfig(rpc_timeout_s=1.0))
    try:
        node = StoreNodeProc("1MiB", block=4096, registry=redis.url, heartbeat_s=0.2, store_id="node-r")
        assert reg.get_store("node-r").address == node.address
        StoreNodeClient(node.address, token=TOKEN.encode(), timeout=10).offer_and_push(KEYS[:2], [b"y" * 10] * 2)
        assert reg.lookup(KEYS[:3]) == [("node-r",)] * 2 + [()]
    finally:
        if node is not None:
            node.kill()
        reg.close()
        redis.kill()


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not on PATH")
def test_a_store_node_killed_and_started_again_under_its_id_is_not_the_owner_of_its_old_blocks(tmp_path):
    """A store node SIGKILLed (no remove_store) and started again under the same id holds
    nothing: lookups stop naming it for the blocks of the process before at once, not after
    block_ttl_s; the blocks the new process stores are reported."""
    from tiersync.net.registry.redis_backend import RedisRegistry

    redis = RedisProc(str(tmp_path))
    nodes: list[StoreNodeProc] = []
    reg = RedisRegistry(redis.url, RegistryConfig(rpc_timeout_s=1.0))
    try:
        nodes.append(StoreNodeProc("1MiB", block=4096, registry=redis.url, heartbeat_s=0.2, store_id="node-k"))
        StoreNodeClient(nodes[0].address, token=TOKEN.encode(), timeout=10).offer_and_push(KEYS[:2], [b"z"] * 2)
        assert reg.lookup(KEYS[:2]) == [("node-k",)] * 2
        nodes[0].signal(signal.SIGKILL)
        nodes[0].proc.wait(15)
        nodes.append(StoreNodeProc("1MiB", block=4096, registry=redis.url, heartbeat_s=0.2, store_id="node-k"))
        assert reg.get_store("node-k").address == nodes[1].address
        assert reg.lookup(KEYS[:2]) == [(), ()]
        StoreNodeClient(nodes[1].address, token=TOKEN.encode(), timeout=10).offer_and_push(KEYS[1:2], [b"w"])
        assert reg.lookup(KEYS[:2]) == [(), ("node-k",)]
    finally:
        for node in nodes:
            node.kill()
        reg.close()
        redis.kill()


def test_a_store_node_on_redis_directly_sweeps_expired_store_records(tmp_path):
    """With ``--registry redis://`` there is no registry process to sweep: the record of every
    store id ever used (a pod's hostname each restart) stayed in the hash, read by each lookup."""
    import time

    import redis as redis_py

    from tiersync.net.registry.base import StoreInfo
    from tiersync.net.registry.redis_backend import RedisRegistry

    redis = RedisProc(str(tmp_path))
    node = None
    cfg = RegistryConfig(heartbeat_interval_s=10, store_ttl_s=30)
    past = RedisRegistry(redis.url, cfg, clock=lambda: time.time() - 3600)
    raw = redis_py.Redis.from_url(redis.url)
    try:
        past.register_store(StoreInfo("gone", "127.0.0.1:1", 10, "g"))  # its record expired an hour ago
        assert raw.hexists("tiersync:stores", "gone")
        node = StoreNodeProc("1MiB", block=4096, registry=redis.url, heartbeat_s=0.2, store_id="node-r")
        assert wait_until(lambda: not raw.hexists("tiersync:stores", "gone"))
        assert raw.hexists("tiersync:stores", "node-r")  # the live one stays
    finally:
        if node is not None:
            node.kill()
        past.close()
        raw.close()
        redis.kill()


def test_a_registry_process_with_a_token_takes_only_nodes_that_prove_it(tmp_path):
    """`tiersync registry --token-file`: a store node with that token registers and advertises;
    one with another token is refused on every call and never appears; a client without it sees
    nothing (lookups degrade as on an outage)."""
    from _peer import RegistryProc
    from tiersync.net.errors import AuthError
    from tiersync.net.registry.grpc_service import RegistryClient

    secret = tmp_path / "token"
    secret.write_text(TOKEN + "\n")
    registry = RegistryProc(token_file=str(secret))
    good = bad = None
    reg = RegistryClient(registry.address, RegistryConfig(token=TOKEN))
    outsider = RegistryClient(registry.address)
    try:
        good = StoreNodeProc("1MiB", block=4096, registry=registry.address, heartbeat_s=0.2, store_id="good")
        bad = StoreNodeProc(
            "1MiB",
            block=4096,
            token="another-token-0123456789",
            registry=registry.address,
            heartbeat_s=0.2,
            store_id="bad",
        )
        StoreNodeClient(good.address, token=TOKEN.encode(), timeout=10).offer_and_push(KEYS[:2], [b"g" * 4096] * 2)
        assert wait_until(lambda: reg.lookup(KEYS[:3]) == [("good",)] * 2 + [()])
        assert "token required (from --token-file)" in "".join(registry.tail)
        registry.wait_for("refused a RegisterStore call", 15)  # the bad node tried and was logged
        bad.wait_for("registry refused the token of store bad", 15)
        assert reg.get_store("bad") is None
        assert [s.store_id for s in reg.placement_targets("", 5)] == ["good"]
        assert outsider.lookup(KEYS[:2]) == [(), ()]
        with pytest.raises(AuthError):
            outsider.remove_store("good")
        assert reg.get_store("good") is not None
    finally:
        for node in (good, bad):
            if node is not None:
                node.kill()
        reg.close()
        outsider.close()
        registry.kill()


def test_a_key_stored_while_a_full_publish_runs_is_advertised():
    """The node commits a block while the agent's full register + publish runs (a snapshot of
    what it held was taken before): that block is advertised by the next beat. The full publish
    used to clear the mark its announcement left, so the block stayed unknown to lookups until
    the next full re-publish (republish_interval_s, 30 min)."""
    held, new = [bytes([1]) * 16], bytes([2]) * 16
    gate, inside = threading.Event(), threading.Event()

    class SlowFirstPublish(MemoryRegistry):
        def publish(self, store_id, keys):
            if not gate.is_set():
                inside.set()
                gate.wait(30)
            super().publish(store_id, keys)

    reg = SlowFirstPublish()
    agent = StoreAgent(reg, AgentConfig("s", "127.0.0.1:1"), free_blocks=lambda: 5, held_keys=lambda: list(held))
    first = threading.Thread(target=agent.beat)
    first.start()
    assert inside.wait(30)  # the full publish of the snapshot [held[0]] is under way
    held.append(new)
    agent.announce([new])  # not healthy yet: only marked for the next full publish
    gate.set()
    first.join(30)
    agent.beat()
    assert reg.lookup([held[0], new]) == [("s",), ("s",)]
