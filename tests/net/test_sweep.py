"""The evict sweep from a serving host (a KVCacheStore) to real `tiersync store-node` processes.

The nodes register with an in-process gRPC registry (default 300 s heartbeat, so
the free counts they registered with stay as placement saw them). The serving
host's device pool is a numpy array of 1 KiB blocks; key i is saved from row i.
"""

from __future__ import annotations

import signal
import threading

import numpy as np
import pytest

from _peer import TOKEN, StoreNodeProc
from tiersync.errors import UsageError
from tiersync.layout.adapters import kv_layout
from tiersync.net import store_ops as so
from tiersync.net.registry.base import StoreInfo
from tiersync.net.registry.grpc_service import RegistryClient, serve_registry
from tiersync.net.registry.memory import MemoryRegistry
from tiersync.net.store_client import StoreNodeClient
from tiersync.net.sweep import RemoteTier, SweepConfig
from tiersync.store import KVCacheStore, Residency, StoreConfig

BLOCK = 1024
CFG = SweepConfig(token=TOKEN.encode(), timeout_s=10.0)


class Host:
    """A serving host: ``n`` device rows, a store of ``n`` host blocks, key i <-> row i."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.dev = np.random.default_rng(seed).integers(0, 256, (n, BLOCK), dtype=np.uint8)
        self.ref = self.dev.copy()
        self.store = KVCacheStore(kv_layout([self.dev]), StoreConfig(host_blocks=n))
        assert self.store.arena.block_nbytes == BLOCK
        self.keys = [b"h" + i.to_bytes(15, "little") for i in range(n)]

    def save(self, lo: int, hi: int) -> None:
        assert self.store.save(list(range(lo, hi)), self.keys[lo:hi]).result(60).saved == tuple(self.keys[lo:hi])

    def blocks(self, lo: int, hi: int) -> list[bytes]:
        """The host image of rows ``lo:hi`` (one pool: the row's bytes)."""
        return [self.ref[i].tobytes() for i in range(lo, hi)]

    @property
    def free(self) -> int:
        return self.store.stats().host_free_blocks

    def residency(self, lo: int, hi: int) -> set[Residency]:
        return set(self.store.residency(self.keys[lo:hi]))

    def assert_reads_back(self, lo: int, hi: int) -> None:
        """Lookup hits ``keys[lo:hi]``; loading them into zeroed rows gives the saved bytes."""
        rows = list(range(lo, hi))
        hit = self.store.lookup(self.keys[lo:hi])
        assert hit.complete, (hit.num_hits, hi - lo)
        self.dev[rows] = 0
        self.store.load(self.keys[lo:hi], rows).result(60)
        assert np.array_equal(self.dev[rows], self.ref[rows])

    def close(self) -> None:
        self.store.close()


@pytest.fixture
def registry():
    server = serve_registry(MemoryRegistry())
    client = RegistryClient(server.address)
    yield server.address, client
    client.close()
    server.stop()


@pytest.fixture
def nodes(registry):
    started: list[StoreNodeProc] = []

    def start(blocks: int) -> StoreNodeProc:
        n = StoreNodeProc(f"{blocks * BLOCK}", block=BLOCK, registry=registry[0])
        started.append(n)
        return n

    yield start
    for n in started:
        n.kill()


def _client(address: str) -> StoreNodeClient:
    return StoreNodeClient(address, token=TOKEN.encode(), timeout=10.0)


def test_sweep_starts_under_low_stops_at_high_in_batches_of_at_most_128_and_reads_back(registry, nodes):
    node = nodes(256)
    host = Host(4000)  # low watermark 3% = 120 free blocks, high 5% = 200
    tier = RemoteTier(host.store, registry[1], CFG)
    try:
        host.save(0, 3870)
        assert host.free == 130 and not tier.needed() and tier.sweep().batches == []
        host.save(3870, 4000)
        assert host.free == 0 and tier.needed()
        report = tier.sweep()
        assert report.batches == [128, 72] and report.remote == {node.store_id: 200} and report.local == 0
        assert host.free == 200 and report.freed == 200
        assert host.residency(0, 200) == {Residency.REMOTE} and host.residency(200, 4000) == {Residency.HOST}
        assert registry[1].lookup(host.keys[:200]) == [(node.store_id,)] * 200  # the node advertised them
        hit = host.store.lookup(host.keys)
        assert hit.num_hits == 0  # the coldest went first: the hole is at the front
        host.store.release(hit.keys)
        assert tier.fill(host.keys) == 200
        host.assert_reads_back(0, 4000)
        assert host.residency(0, 200) == {Residency.HOST | Residency.REMOTE}
    finally:
        host.close()


def test_a_full_target_refuses_and_the_next_target_gets_the_blocks(registry, nodes):
    full, spare = nodes(64), nodes(32)  # placement tries `full` first: it registered 64 free blocks
    _client(full.address).offer_and_push(
        [b"x" + i.to_bytes(15, "little") for i in range(50)], [bytes([i]) * BLOCK for i in range(50)]
    )  # 14 free left
    host = Host(400)  # sweep: 0 free -> 20
    tier = RemoteTier(host.store, registry[1], CFG)
    try:
        host.save(0, 400)
        report = tier.sweep()
        assert report.batches == [20] and report.refused == [full.store_id]
        assert report.remote == {spare.store_id: 20} and host.free == 20
        assert registry[1].lookup(host.keys[:20]) == [(spare.store_id,)] * 20
        assert tier.fill(host.keys[:20]) == 20
        host.assert_reads_back(0, 20)
    finally:
        host.close()


def test_with_no_target_the_sweep_evicts_locally(registry, nodes):
    host = Host(400)
    tier = RemoteTier(host.store, registry[1], CFG)
    try:
        host.save(0, 400)
        report = tier.sweep()  # no store node registered at all
        assert report.batches == [20] and report.local == 20 and report.remote == {} and host.free == 20
        assert host.residency(0, 20) == {Residency.NONE} and host.residency(20, 400) == {Residency.HOST}
        full = nodes(8)  # one registered node, too small for a batch: it refuses, so local again
        host.save(0, 20)
        report = tier.sweep()
        assert report.refused == [full.store_id] and report.local == 20 and host.free == 20
        assert tier.fill(host.keys) == 0  # nothing remote to fill from
    finally:
        host.close()


def test_partial_exist_counts_as_placed(registry, nodes):
    node = nodes(64)
    host = Host(400)
    tier = RemoteTier(host.store, registry[1], CFG)
    try:
        host.save(0, 400)
        _client(node.address).offer_and_push(host.keys[:5], host.blocks(0, 5))  # 5 of the 20 coldest, ahead
        report = tier.sweep()
        assert report.partial == 1 and report.remote == {node.store_id: 20} and host.free == 20
        assert tier.fill(host.keys) == 20
        host.assert_reads_back(0, 400)
    finally:
        host.close()


def test_node_killed_mid_push_releases_the_batch_and_the_next_target_takes_it(registry, nodes):
    first, second = nodes(64), nodes(32)
    pulled = threading.Event()

    def hook(_pull: so.Pull) -> None:  # runs in our source server, before the PULL is answered
        if not pulled.is_set():
            pulled.set()
            first.kill()

    def make(address: str) -> StoreNodeClient:
        on_pull = hook if address == first.address else None
        return StoreNodeClient(address, token=TOKEN.encode(), timeout=5.0, on_pull=on_pull)

    host = Host(400)
    tier = RemoteTier(host.store, registry[1], CFG, client=make)
    try:
        host.save(0, 400)
        done: list = []
        t = threading.Thread(target=lambda: done.append(tier.sweep()))
        t.start()
        t.join(30)  # well within: one failed push (5 s deadline at most) and one good one
        assert not t.is_alive() and pulled.is_set()
        report = done[0]
        assert report.failed == [first.store_id] and report.remote == {second.store_id: 20}
        stats = host.store.stats()
        assert stats.pinned == 0 and host.free == 20 and stats.host_evictable == 380  # nothing left held
        assert tier.fill(host.keys) == 20
        host.assert_reads_back(0, 400)
    finally:
        host.close()


def test_read_back_from_a_stopped_owner_fails_cleanly_and_the_next_owner_serves(registry, nodes):
    a, b = nodes(64), nodes(64)
    host = Host(400)
    tier = RemoteTier(host.store, registry[1], SweepConfig(token=TOKEN.encode(), timeout_s=1.5))
    try:
        host.save(0, 400)
        other = b if registry[1].placement_targets("", 1)[0].store_id == a.store_id else a
        _client(other.address).offer_and_push(host.keys[:20], host.blocks(0, 20))  # the sweep uses the other
        assert sum(tier.sweep().remote.values()) == 20
        owners = registry[1].lookup(host.keys[:20])
        assert all(set(o) == {a.store_id, b.store_id} for o in owners)
        procs = {a.store_id: a, b.store_id: b}
        for p in procs.values():
            p.signal(signal.SIGSTOP)  # both owners hang: each read times out
        assert tier.fill(host.keys) == 0
        stats = host.store.stats()
        assert host.free == 20 and stats.pinned == 0 and stats.host_entries == 380  # landing blocks freed
        procs[owners[0][0]].kill()  # the owner tried first is gone for good
        procs[owners[0][1]].signal(signal.SIGCONT)
        assert tier.fill(host.keys) == 20
        host.assert_reads_back(0, 400)
    finally:
        host.close()


def test_an_owner_that_fails_a_run_is_left_out_and_the_others_fill_its_parts(registry, nodes):
    """Keys 0-9 are on nodes X and Y, keys 10-19 on X and Z: all 20 share X only, so they were
    one run from X. X gone (its registry entries live on until they expire), the fill read
    nothing; it now asks Y for the first ten and Z for the others."""
    x, y, z = nodes(64), nodes(64), nodes(64)
    src, host = Host(20), Host(20)
    tier = RemoteTier(host.store, registry[1], SweepConfig(token=TOKEN.encode(), timeout_s=1.5))
    try:
        for node, lo, hi in ((x, 0, 20), (y, 0, 10), (z, 10, 20)):
            _client(node.address).offer_and_push(src.keys[lo:hi], src.blocks(lo, hi))
        owners = registry[1].lookup(host.keys)
        assert [set(o) for o in owners] == [{x.store_id, y.store_id}] * 10 + [{x.store_id, z.store_id}] * 10
        x.kill()
        assert tier.fill(host.keys) == 20
        host.assert_reads_back(0, 20)
    finally:
        src.close()
        host.close()


def test_background_sweeper_reacts_to_the_low_watermark(registry, nodes):
    node = nodes(64)
    host = Host(400)
    tier = RemoteTier(host.store, registry[1], CFG)
    try:
        tier.start(interval_s=0.05)
        with pytest.raises(UsageError):
            tier.start()
        host.save(0, 400)
        tier.trigger()
        assert tier.wait_sweeps(1, timeout=30)
        assert host.free >= 20 and host.residency(0, 20) == {Residency.REMOTE}
        assert registry[1].lookup(host.keys[:1]) == [(node.store_id,)]
    finally:
        tier.close()
        host.close()


def test_config_and_give_back_are_validated():
    with pytest.raises(UsageError):
        SweepConfig(batch=129)
    with pytest.raises(UsageError):
        SweepConfig(low_watermark=0.2, high_watermark=0.1)
    from tiersync.net.tls import TlsConfig

    for tls in (TlsConfig("/ca.pem"), "ca.pem"):  # a sweep serves its pushes: it needs a certificate
        with pytest.raises(UsageError, match=r"SweepConfig\.tls"):
            SweepConfig(tls=tls)
    host = Host(8)
    try:
        host.save(0, 8)
        with pytest.raises(UsageError):
            host.store.give_back(host.keys[:1])  # not taken
        taken = host.store.take_evictable(3)
        assert len(taken) == 3 and host.store.stats().host_evictable == 5
        assert host.store.give_back([k for k, _ in taken], drop=True) == 3 and host.free == 3
    finally:
        host.close()


def test_a_registry_entry_no_client_can_use_is_skipped_not_raised(registry, nodes):
    """Registry entries are other processes' writes: one whose address is not an address (and
    that claims the most free blocks, so placement tries it first) fails that target only."""
    node = nodes(64)
    poison = StoreInfo("poison", "nohost", free_blocks=1 << 40)
    registry[1].register_store(poison)
    host = Host(400)
    tier = RemoteTier(host.store, registry[1], CFG)
    try:
        host.save(0, 400)
        report = tier.sweep()  # before: UsageError from the poisoned target, nothing moved
        assert report.failed == ["poison"] and report.remote == {node.store_id: 20} and host.free == 20
        registry[1].unpublish(node.store_id, host.keys[:20])
        registry[1].publish("poison", host.keys[:20])  # only the poisoned node "owns" them now
        hit = host.store.lookup(host.keys[:20])
        host.store.release(hit.keys)
        assert tier.fill(host.keys[:20]) == 0  # before: UsageError out of fill
        registry[1].publish(node.store_id, host.keys[:20])
        assert tier.fill(host.keys[:20]) == 20  # read back from the node that has them
        host.assert_reads_back(0, 20)
    finally:
        host.close()
