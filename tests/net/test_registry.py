"""Registry behaviour, one suite run against every backend: memory, redis, memory-behind-gRPC.

TTLs are driven by an injected clock (no sleeps). The Redis backend talks to a
real ``redis-server`` started on a free loopback port in a temp dir; those
cases are skipped, with the reason printed, only when the binary is absent.
"""

from __future__ import annotations

import dataclasses
import shutil
import uuid

import pytest

from _peer import RedisProc
from tiersync.errors import UsageError
from tiersync.net.registry.base import RegistryConfig, StoreInfo
from tiersync.net.registry.memory import MemoryRegistry

CFG = RegistryConfig(heartbeat_interval_s=300, store_ttl_s=600, block_ttl_s=3600, rpc_timeout_s=2.0)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    if shutil.which("redis-server") is None:
        print("SKIP redis backend: redis-server binary not found on PATH")
        pytest.skip("redis-server binary not found on PATH")
    proc = RedisProc(str(tmp_path_factory.mktemp("redis")))
    try:
        yield proc.url
    finally:
        proc.kill()


@pytest.fixture(params=["memory", "redis", "grpc"])
def registry(request):
    clock = Clock()
    if request.param == "memory":
        reg = MemoryRegistry(CFG, clock)
        yield reg, clock
        return
    if request.param == "redis":
        from tiersync.net.registry.redis_backend import RedisRegistry

        url = request.getfixturevalue("redis_url")
        reg = RedisRegistry(url, _with_prefix(f"t{uuid.uuid4().hex}:"), clock)
        yield reg, clock
        reg.close()
        return
    from tiersync.net.registry.grpc_service import RegistryClient, serve_registry

    server = serve_registry(MemoryRegistry(CFG, clock))
    client = RegistryClient(server.address, CFG)
    yield client, clock
    client.close()
    server.stop()


def _with_prefix(prefix: str) -> RegistryConfig:
    return dataclasses.replace(CFG, key_prefix=prefix)


def keys(n: int, seed: int = 0) -> list[bytes]:
    return [seed.to_bytes(4, "little") + i.to_bytes(12, "little") for i in range(n)]


def _stores(reg) -> None:
    reg.register_store(StoreInfo("a", "127.0.0.1:7001", 100, "g1"))
    reg.register_store(StoreInfo("b", "127.0.0.1:7002", 500, "g2"))
    reg.register_store(StoreInfo("c", "127.0.0.1:7003", 50, "g1"))


def test_lookup_reports_owners_in_input_order_across_batches(registry):
    reg, _ = registry
    _stores(reg)
    ks = keys(600)
    reg.publish("a", ks[:400])
    reg.publish("b", ks[300:])
    missing = keys(3, seed=9)
    got = reg.lookup(ks + missing)
    assert len(got) == 603
    assert all(set(o) == {"a"} for o in got[:300])
    assert all(set(o) == {"a", "b"} for o in got[300:400])
    assert all(set(o) == {"b"} for o in got[400:600])
    assert got[600:] == [(), (), ()]
    assert reg.lookup([]) == []


def test_unpublish_and_remove_store_hide_blocks(registry):
    reg, _ = registry
    _stores(reg)
    ks = keys(10)
    reg.publish("a", ks)
    reg.publish("b", ks[:5])
    reg.unpublish("a", ks[:2])
    assert [set(o) for o in reg.lookup(ks[:3])] == [{"b"}, {"b"}, {"a", "b"}]
    reg.remove_store("b")
    assert reg.lookup(ks[:3]) == [(), (), ("a",)]
    assert reg.get_store("b") is None
    reg.remove_store("b")  # idempotent


def test_store_expires_without_heartbeat_and_heartbeat_keeps_it(registry):
    reg, clock = registry
    _stores(reg)
    ks = keys(4)
    reg.publish("a", ks)
    reg.publish("b", ks)
    clock.now += 500
    assert reg.heartbeat("a", 42) is True
    clock.now += 200  # b last heard 700 s ago > store_ttl 600; a 200 s ago
    assert [set(o) for o in reg.lookup(ks)] == [{"a"}] * 4
    assert reg.get_store("a") == StoreInfo("a", "127.0.0.1:7001", 42, "g1")
    assert reg.get_store("b") is None
    assert reg.heartbeat("b", 1) is False  # must re-register
    reg.register_store(StoreInfo("b", "127.0.0.1:7002", 500, "g2"))
    assert [set(o) for o in reg.lookup(ks)] == [{"a", "b"}] * 4


def test_block_entries_expire_unless_republished(registry):
    reg, clock = registry
    _stores(reg)
    old, fresh = keys(3), keys(3, seed=1)
    reg.publish("a", old)
    for _ in range(7):  # 3500 s of heartbeats keep the store alive
        clock.now += 500
        assert reg.heartbeat("a", 10)
    reg.publish("a", fresh)
    clock.now += 200  # old published 3700 s ago > block_ttl 3600
    assert reg.heartbeat("a", 10)
    assert reg.lookup(old + fresh) == [()] * 3 + [("a",)] * 3


def test_placement_prefers_same_pool_group_then_most_free(registry):
    reg, clock = registry
    _stores(reg)
    reg.register_store(StoreInfo("full", "127.0.0.1:7004", 0, "g1"))
    ids = [s.store_id for s in reg.placement_targets("g1", 10)]
    assert ids == ["a", "c", "b"]  # g1 by free blocks desc, then g2; full store skipped
    assert [s.store_id for s in reg.placement_targets("g2", 2)] == ["b", "a"]
    assert [s.store_id for s in reg.placement_targets("g1", 10, exclude=["a"])] == ["c", "b"]
    clock.now += 700
    assert reg.placement_targets("g1", 10) == []


def test_bad_keys_are_usage_errors(registry):
    reg, _ = registry
    with pytest.raises(UsageError):
        reg.publish("a", [b"short"])
    with pytest.raises(UsageError):
        StoreInfo("", "x", 1)


def test_store_record_keeps_capacity_through_heartbeats(registry):
    reg, _ = registry
    reg.register_store(StoreInfo("a", "127.0.0.1:7001", 100, "g1", capacity_blocks=128))
    assert reg.heartbeat("a", 7)
    assert reg.get_store("a") == StoreInfo("a", "127.0.0.1:7001", 7, "g1", capacity_blocks=128)
    assert reg.placement_targets("g1", 1)[0].capacity_blocks == 128


def test_blocks_of_a_store_that_is_not_registered_are_not_recorded(registry):
    """An unauthenticated caller could otherwise grow the registry with made-up store ids."""
    reg, clock = registry
    _stores(reg)
    reg.publish("nobody", keys(50))
    assert reg.lookup(keys(50)) == [()] * 50
    reg.publish("a", keys(2))
    clock.now += CFG.store_ttl_s + 1  # "a" expired without a heartbeat: its publishes are ignored too
    reg.publish("a", keys(2, seed=1))
    reg.register_store(StoreInfo("a", "127.0.0.1:7001", 100, "g1"))
    assert reg.lookup(keys(2, seed=1)) == [(), ()] and reg.lookup(keys(2)) == [("a",), ("a",)]


def test_store_fields_are_bounded_in_utf8_bytes_as_the_wire_bounds_them():
    with pytest.raises(UsageError) as info:
        StoreInfo("€" * 100, "127.0.0.1:1", 1)  # 100 characters, 300 bytes
    assert info.value.argument == "store_id"
    with pytest.raises(UsageError) as info:
        StoreInfo("s", "€" * 200, 1)
    assert info.value.argument == "address"


def test_a_redis_record_another_writer_broke_is_skipped_by_readers(redis_url):
    from tiersync.net.registry.redis_backend import RedisRegistry

    clock = Clock()
    reg = RedisRegistry(redis_url, _with_prefix(f"t{uuid.uuid4().hex}:"), clock)
    try:
        _stores(reg)
        reg.publish("a", keys(3))
        stores_key = reg._stores_key  # white box: what a foreign writer of the same Redis would touch
        reg._redis.hset(stores_key, "broken", b"{not json")
        reg._redis.hset(stores_key, "partial", b'{"address": "127.0.0.1:9"}')  # no expires_at
        assert reg.lookup(keys(3)) == [("a",)] * 3
        assert {t.store_id for t in reg.placement_targets("g1", 8)} == {"a", "b", "c"}
        assert reg.get_store("broken") is None and reg.get_store("a") is not None
    finally:
        reg.close()


def test_redis_sweep_drops_dead_store_records_and_publish_drops_dead_owners(redis_url):
    """The stores hash does not grow with every store that ever lived (each lookup reads all of
    it): sweep drops records whose time ran out, atomically, keeping live and re-registered
    stores and records another writer broke; a publish prunes the key's expired owners."""
    from tiersync.net.registry.redis_backend import RedisRegistry

    clock = Clock()
    reg = RedisRegistry(redis_url, _with_prefix(f"t{uuid.uuid4().hex}:"), clock)
    try:
        _stores(reg)
        reg.publish("a", keys(2))
        reg._redis.hset(reg._stores_key, "broken", b"not json")
        clock.now += CFG.store_ttl_s / 2
        reg.heartbeat("b", 400)  # b re-registers: its time starts again
        clock.now += CFG.store_ttl_s / 2 + 1  # a and c ran out, b has not
        assert reg.sweep() == 2
        assert set(reg._redis.hkeys(reg._stores_key)) == {b"b", b"broken"}
        assert reg.get_store("b").free_blocks == 400 and reg.sweep() == 0
        reg.publish("b", keys(2))
        clock.now += CFG.block_ttl_s  # a's ownership entries ran out too
        reg.register_store(StoreInfo("a", "127.0.0.1:7001", 100, "g1"))
        reg.publish("a", keys(1))  # touches key 0: its dead owners go (b's entry ran out too)
        assert reg._redis.zrange(reg._blk + keys(1)[0], 0, -1) == [bytes(8) + b"a"]  # incarnation 0, then the id
        assert reg.lookup(keys(2)) == [("a",), ()]
    finally:
        reg.close()


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://:hunter2@10.0.0.5:6379/1", "redis://:***@10.0.0.5:6379/1"),
        ("rediss://svc:p%40ss@redis.example:6380/0", "rediss://svc:***@redis.example:6380/0"),
        ("redis://only-user@h:1/0", "redis://only-user@h:1/0"),
        ("redis://:pa/ss#w@rd@h:1/0", "redis://:***@h:1/0"),  # unescaped, up to the last @
        ("redis://h:6379/0?password=pw&db=1", "redis://h:6379/0?password=***&db=1"),
        ("127.0.0.1:7500", "127.0.0.1:7500"),  # a gRPC registry address: nothing to hide
    ],
)
def test_a_password_in_the_redis_url_is_never_shown(url, shown):
    """Logs and errors show the Redis URL without its password (the registry's health lines
    and RegistryUnavailableError name the URL)."""
    from tiersync.net.registry.redis_backend import shown_url

    assert shown_url(url) == shown


def test_a_store_restarted_under_its_id_is_not_reported_with_what_it_held_before(registry):
    """A store node restarted on the same id (its host:port by default) comes back empty: what
    the process before published is not reported as this one's (a lookup named it as the owner
    of blocks it no longer had, for up to block_ttl_s); what it publishes now is. An unpublish
    while the record ran out still removes the entries (they came back with it before)."""
    reg, clock = registry
    ks = keys(4)
    reg.register_store(StoreInfo("a", "127.0.0.1:7001", 100, "g1", incarnation=11))
    reg.publish("a", ks)
    assert reg.lookup(ks) == [("a",)] * 4
    reg.register_store(StoreInfo("a", "127.0.0.1:7001", 100, "g1", incarnation=11))  # a re-registration: kept
    assert reg.heartbeat("a", 90) and reg.lookup(ks) == [("a",)] * 4
    reg.register_store(StoreInfo("a", "127.0.0.1:7001", 100, "g1", incarnation=22))  # restarted
    assert reg.lookup(ks) == [()] * 4
    assert reg.heartbeat("a", 80) and reg.get_store("a").incarnation == 22
    reg.publish("a", ks[:2])
    assert reg.lookup(ks) == [("a",), ("a",), (), ()]
    reg.unpublish("a", ks[:1])
    assert reg.lookup(ks) == [(), ("a",), (), ()]
    clock.now += CFG.store_ttl_s + 1  # the record ran out (a stalled node): its entries are still its own
    reg.unpublish("a", ks[1:2])
    reg.register_store(StoreInfo("a", "127.0.0.1:7001", 100, "g1", incarnation=22))  # back, same process
    assert reg.lookup(ks) == [()] * 4


def test_a_redis_heartbeat_does_not_bring_back_a_store_removed_while_it_ran(redis_url):
    """A heartbeat read the record, then wrote it back refreshed: a remove_store in between (a
    node closing while its last heartbeat was slow) was undone, and the gone node stayed live
    for store_ttl_s. The heartbeat is one step now."""
    from tiersync.net.registry.redis_backend import RedisRegistry

    reg = RedisRegistry(redis_url, _with_prefix(f"t{uuid.uuid4().hex}:"), Clock())
    try:
        reg.register_store(StoreInfo("a", "127.0.0.1:7001", 100, "g1", incarnation=5))
        reg.publish("a", keys(2))
        real, calls = reg._call, []

        def call(fn, *args):
            out = real(fn, *args)
            calls.append(fn)
            if len(calls) == 1:  # the heartbeat's first step is done: the node is removed now
                real(reg._redis.hdel, reg._stores_key, "a")
            return out

        reg._call = call
        reg.heartbeat("a", 50)
        reg._call = real
        assert reg.get_store("a") is None and reg.lookup(keys(2)) == [(), ()]
    finally:
        reg.close()
