"""Store node: remote writes and reads against real `tiersync store-node` processes (loopback)."""

from __future__ import annotations

import contextlib
import itertools
import os
import threading

import numpy as np
import pytest

from _peer import TOKEN, wait_until
from _peer import StoreNodeProc as Node
from tiersync.errors import CapacityError, RemoteError
from tiersync.net import events as ev
from tiersync.net import store_ops as so
from tiersync.net.errors import AuthError, ProtocolError
from tiersync.net.source import MemoryBlockSource
from tiersync.net.store_node import StoreNode, StoreNodeClient, StoreNodeServer
from tiersync.net.tcp import TcpConfig, TcpTransport

BLOCK = 256 << 10


def _keys(n: int, tag: int = 0) -> list[bytes]:
    return [bytes([tag]) + i.to_bytes(15, "little") for i in range(n)]


def _bufs(n: int, seed: int = 1) -> list[bytes]:
    return [os.urandom(BLOCK - 7 * i) for i in range(n)]


@pytest.fixture
def node():
    n = Node()
    yield n
    n.kill()


def client(address: str, **kw) -> StoreNodeClient:
    return StoreNodeClient(address, token=TOKEN.encode(), timeout=kw.pop("timeout", 10.0), **kw)


def test_write_then_read_byte_exact_and_all_exist(node):
    keys, bufs = _keys(6), _bufs(6)
    c = client(node.address)
    res = c.offer_and_push(keys, bufs)
    assert res.offer is so.OfferStatus.ACCEPT and res.commit is ev.CommitStatus.COMMITTED
    into = [bytearray(BLOCK) for _ in keys]
    sizes = c.read(keys, into)
    assert [bytes(b[:s]) for b, s in zip(into, sizes)] == bufs
    again = c.offer_and_push(keys, bufs)
    assert again.offer is so.OfferStatus.ALL_EXIST and set(again.existing) == set(keys)
    more, more_bufs = keys[:2] + _keys(2, tag=9), bufs[:2] + _bufs(2)
    part = c.offer_and_push(more, more_bufs)
    assert part.offer is so.OfferStatus.PARTIAL_EXIST and set(part.existing) == set(keys[:2])
    into = [bytearray(BLOCK) for _ in more]
    sizes = c.read(more, into)
    assert [bytes(b[:s]) for b, s in zip(into, sizes)] == more_bufs


def test_capacity_full_is_refused_without_eviction(node):
    c = client(node.address)  # 4 MiB / 256 KiB = 16 blocks
    first, first_bufs = _keys(12), _bufs(12)
    c.offer_and_push(first, first_bufs)
    with pytest.raises(CapacityError):
        c.offer_and_push(_keys(8, tag=1), _bufs(8))
    into = [bytearray(BLOCK) for _ in first]  # nothing was evicted to make room
    sizes = c.read(first, into)
    assert [bytes(b[:s]) for b, s in zip(into, sizes)] == first_bufs
    assert c.offer_and_push(_keys(4, tag=2), _bufs(4)).commit is ev.CommitStatus.COMMITTED  # exactly fits


def test_node_killed_mid_transfer_then_retry_elsewhere(node):
    other = Node()
    try:
        pulled, killed = threading.Event(), threading.Event()

        def hook(_pull: so.Pull) -> None:
            if not killed.is_set():
                pulled.set()
                killed.wait(10)

        keys, bufs = _keys(4), _bufs(4)
        c = client(node.address, timeout=8.0, on_pull=hook)
        outcome: list[BaseException] = []

        def push() -> None:
            try:
                c.offer_and_push(keys, bufs)
            except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
                outcome.append(exc)

        t = threading.Thread(target=push)
        t.start()
        assert pulled.wait(10)
        node.kill()
        killed.set()
        t.join(10)
        assert not t.is_alive() and len(outcome) == 1 and isinstance(outcome[0], RemoteError), outcome
        retry = client(other.address)
        assert retry.offer_and_push(keys, bufs).commit is ev.CommitStatus.COMMITTED
        into = [bytearray(BLOCK) for _ in keys]
        sizes = retry.read(keys, into)
        assert [bytes(b[:s]) for b, s in zip(into, sizes)] == bufs
    finally:
        other.kill()


def test_peer_without_the_token_is_refused(node):
    with pytest.raises(AuthError):
        StoreNodeClient(node.address, token=None, timeout=5.0).read(_keys(1), [bytearray(BLOCK)])
    with pytest.raises(AuthError):
        StoreNodeClient(node.address, token=b"wrong-token-wrong-token!", timeout=5.0).offer_and_push(_keys(1), _bufs(1))


def test_missing_key_read_is_a_remote_error(node):
    with pytest.raises(RemoteError):
        client(node.address).read(_keys(1, tag=7), [bytearray(BLOCK)])


def test_lease_expiry_unpins_and_fails_the_release():
    """In-process node with a fake clock: an expired read lease no longer serves, and unpins."""
    now = [0.0]
    node = StoreNode(1 << 20, BLOCK, config=TcpConfig(token=TOKEN.encode()), clock=lambda: now[0])
    server = StoreNodeServer("127.0.0.1:0", node)
    try:
        keys, bufs = _keys(2), _bufs(2)
        client(server.address).offer_and_push(keys, bufs)
        ch = TcpTransport(TcpConfig(token=TOKEN.encode())).connect(server.address)
        lease = ch.request(so.ReadLease(ch.new_request_id(), tuple(keys), ttl_s=1))
        assert lease.status is so.LeaseStatus.GRANTED and lease.ttl_s == 30 and node.active_leases == 1
        assert node.holds(lease.lease_id)
        now[0] += 31
        assert not node.holds(lease.lease_id)  # what a connection at its lease cap counts
        with pytest.raises(RemoteError) as err:
            ch.request(so.Pull(ch.new_request_id(), lease.lease_id, keys[0], 0, 16))
        assert err.value.code is ev.ErrorCode.LEASE_EXPIRED and node.active_leases == 0
        done = ch.request(so.Release(ch.new_request_id(), lease.lease_id))
        assert done.status is ev.CommitStatus.FAILED
        assert all(node.arena.allocator.lock_count(b) == 1 for b, *_ in node._index.values())
        ch.close()
    finally:
        server.close()
        node.close()


def test_whole_block_reads_use_the_checksum_kept_since_the_write():
    """A stored block is summed once when it lands: a whole-block read is sent with that sum
    (no pass over the bytes per read), so bytes that changed in the node's memory afterwards
    are refused by the reader (BAD_CHECKSUM), never delivered; a partial read is summed as sent."""
    from tiersync.net.errors import ProtocolError, ProtocolFault
    from tiersync.net.frames import SUPPORTED, payload_checksum

    node = StoreNode(1 << 20, BLOCK, config=TcpConfig(token=TOKEN.encode()))
    server = StoreNodeServer("127.0.0.1:0", node)
    try:
        keys, bufs = _keys(2), _bufs(2)
        client(server.address).offer_and_push(keys, bufs)
        ch = TcpTransport(TcpConfig(token=TOKEN.encode())).connect(server.address)
        lease = ch.request(so.ReadLease(ch.new_request_id(), tuple(keys), ttl_s=60))
        view, known = node.view(lease.lease_id, keys[0], 0, len(bufs[0]))
        assert known == (SUPPORTED[0], payload_checksum(SUPPORTED[0], bufs[0])) and bytes(view) == bufs[0]
        assert node.view(lease.lease_id, keys[0], 16, 100)[1] is None
        into = bytearray(len(bufs[0]))
        ch.request(so.Pull(ch.new_request_id(), lease.lease_id, keys[0], 0, len(into)), into=into)
        assert bytes(into) == bufs[0]
        view[1000] ^= 0xFF  # the node's copy changes after it was stored
        with pytest.raises(ProtocolError) as err:
            ch.request(so.Pull(ch.new_request_id(), lease.lease_id, keys[0], 0, len(into)), into=bytearray(len(into)))
        assert err.value.fault is ProtocolFault.BAD_CHECKSUM
        ch2 = TcpTransport(TcpConfig(token=TOKEN.encode())).connect(
            server.address
        )  # the broken one's lease went with it
        lease2 = ch2.request(so.ReadLease(ch2.new_request_id(), tuple(keys), ttl_s=60))
        part = bytearray(100)
        ch2.request(so.Pull(ch2.new_request_id(), lease2.lease_id, keys[0], 950, 100), into=part)
        assert bytes(part) == bytes(view[950:1050])  # a range is summed as it is sent
        ch.close()
        ch2.close()
    finally:
        server.close()
        node.close()


def test_failed_pull_frees_landing_blocks():
    """The writer's lease is gone before the node pulls: FAILED, and no block stays taken."""
    node = StoreNode(1 << 20, BLOCK)
    server = StoreNodeServer("127.0.0.1:0", node)
    try:
        free = node.free_blocks
        c = StoreNodeClient(server.address, timeout=5.0)
        c._on_pull = lambda pull: (_ for _ in ()).throw(KeyError("writer lost the block"))
        with pytest.raises(RemoteError):
            c.offer_and_push(_keys(2), _bufs(2))
        assert node.free_blocks == free and node.stored == 0
    finally:
        server.close()
        node.close()


def test_a_failed_write_whose_blocks_cannot_be_freed_still_lets_its_keys_be_written_again(monkeypatch):
    """Freeing a failed write's landing blocks raised (as the allocator's first np.unique did out
    of descriptors): its keys used to stay "landing", every later write of them REFUSED until a
    restart. They are freed first now: the same keys are written and read back (the blocks that
    could not be freed are lost, as before)."""
    node = StoreNode(1 << 20, BLOCK)
    server = StoreNodeServer("127.0.0.1:0", node)
    real_free, calls = node.arena.free, []

    def free_once(blocks):
        calls.append(blocks)
        raise OSError(24, "Too many open files")
        return real_free(blocks)

    monkeypatch.setattr(node.arena, "free", free_once)
    try:
        c = StoreNodeClient(server.address, timeout=5.0)
        c._on_pull = lambda pull: (_ for _ in ()).throw(KeyError("writer lost the block"))
        with pytest.raises(RemoteError):
            c.offer_and_push(_keys(2), _bufs(2))
        assert calls  # every attempt to free them failed
        monkeypatch.setattr(node.arena, "free", real_free)
        data = _bufs(2)
        StoreNodeClient(server.address, timeout=5.0).offer_and_push(_keys(2), data)
        out = [bytearray(len(b)) for b in data]
        StoreNodeClient(server.address, timeout=5.0).read(_keys(2), out)
        assert [bytes(o) for o in out] == data
    finally:
        server.close()
        node.close()


def test_a_same_host_reader_copies_out_of_a_map_of_the_node_s_arena(node):
    """A store node's arena is shareable: a same-host reader's PULL_LOCAL answer names the
    node's sealed memfd, the reader maps it (one map, kept across reads and channels: the
    process's channels share their maps) and lands every block byte-exact, verified against the
    checksums kept since the write. The map goes once the node's process exits (its memory
    would stay allocated as long as a map of it lives)."""
    from tiersync.net.config import Route
    from tiersync.net.shared_maps import process_maps

    keys, bufs = _keys(8, tag=4), _bufs(8)
    assert client(node.address).offer_and_push(keys, bufs).commit is ev.CommitStatus.COMMITTED
    channel = TcpTransport(TcpConfig(token=TOKEN.encode(), route=Route.LOCAL)).connect(node.address)
    try:
        lease = channel.request(so.ReadLease(channel.new_request_id(), tuple(keys)))
        for _ in range(2):
            into = [bytearray(len(b)) for b in bufs]
            channel.pull_many(lease.lease_id, [(k, 0, memoryview(d)) for k, d in zip(keys, into)])
            assert [bytes(d) for d in into] == bufs
            assert channel.mapped_sources == 1
        channel.request(so.Release(channel.new_request_id(), lease.lease_id))
    finally:
        channel.close()
    pid = channel.info.pid
    assert process_maps().count(pid) == 1
    node.kill()
    assert wait_until(lambda: process_maps().count(pid) == 0)


@contextlib.contextmanager
def _leased(n: int, tag: int):
    """A node in this process holding ``n`` pushed blocks, its server, their keys and bytes, and a
    lease on them: ``(node, server, keys, bufs, lease_id)``."""
    node = StoreNode(4 * BLOCK, BLOCK, config=TcpConfig(token=TOKEN.encode()))
    server = StoreNodeServer("127.0.0.1:0", node)
    try:
        keys, bufs = _keys(n, tag=tag), _bufs(n)
        assert client(server.address).offer_and_push(keys, bufs).commit is ev.CommitStatus.COMMITTED
        yield node, server, keys, bufs, node.lease(so.ReadLease(1, tuple(keys))).lease_id
    finally:
        server.close()
        node.close()


def test_store_node_views_answer_as_view_does_and_refuse_all_or_nothing():
    """The node's ``views`` checks its lease once for many ranges: the same answers as ``view``
    (a whole block with the checksum kept since its write), and one bad item refuses the call."""
    from tiersync.net.frames import PayloadChecksum, payload_checksum
    from tiersync.net.source import BlockError

    with _leased(2, tag=7) as (node, _server, keys, bufs, lease):
        items = [(keys[0], 0, len(bufs[0])), (keys[1], 3, 100)]
        got = node.views(lease, items)
        assert [bytes(v) for v, _ in got] == [bufs[0], bufs[1][3:103]]
        assert got[0][1] == (PayloadChecksum.TSUM64, payload_checksum(PayloadChecksum.TSUM64, bufs[0]))
        assert got[1][1] is None and [(bytes(v), k) for v, k in got] == [
            (bytes(v), k) for v, k in (node.view(lease, *i) for i in items)
        ]
        past, foreign = (keys[1], len(bufs[1]), 1), (b"\xfe" * 16, 0, 1)
        for bad, code in (([items[0], past, foreign], "BAD_REQUEST"), ([foreign, past], "NOT_FOUND")):
            with pytest.raises(BlockError) as info:  # the first bad item decides, as view would
                node.views(lease, bad)
            assert info.value.code is ev.ErrorCode[code]
        with pytest.raises(BlockError) as info:
            node.views(lease + 99, items)
        assert info.value.code is ev.ErrorCode.LEASE_EXPIRED


def test_store_node_regions_say_where_views_bytes_are_and_refuse_as_views_do():
    """``regions`` (a same-host reader's answer) computes addresses from block ids instead of
    a view per item: the same rows the base derives from ``views`` (address, length, checksum
    by SUPPORTED[0]; a part of a block summed), the same refusals; a same-host reader pulls a
    whole block and a part of one byte-exact through it."""
    from tiersync.net.config import Route
    from tiersync.net.source import BlockError, BlockService

    with _leased(3, tag=9) as (node, server, keys, bufs, lease):
        items = [(keys[2], 0, len(bufs[2])), (keys[0], 5, 1000), (keys[1], 0, len(bufs[1]))]
        got = node.regions(lease, items)
        assert got.dtype == np.uint64 and np.array_equal(got, BlockService.regions(node, lease, items))
        for bad, code in (
            ([items[0], (keys[1], len(bufs[1]), 1)], "BAD_REQUEST"),
            ([(b"\xfe" * 16, 0, 1)], "NOT_FOUND"),
        ):
            with pytest.raises(BlockError) as info:
                node.regions(lease, bad)
            assert info.value.code is ev.ErrorCode[code]
        with pytest.raises(BlockError) as info:
            node.regions(lease + 99, items)
        assert info.value.code is ev.ErrorCode.LEASE_EXPIRED
        channel = TcpTransport(TcpConfig(token=TOKEN.encode(), route=Route.LOCAL)).connect(server.address)
        try:
            reader = channel.request(so.ReadLease(channel.new_request_id(), tuple(keys))).lease_id
            into = [bytearray(n) for _, _, n in items]
            channel.pull_many(reader, [(k, o, memoryview(d)) for (k, o, _), d in zip(items, into)])
            assert [bytes(d) for d in into] == [bufs[2], bufs[0][5:1005], bufs[1]]
        finally:
            channel.close()


class _ShortLease(MemoryBlockSource):
    """A node that grants a lease naming fewer sizes than keys (a buggy or hostile node)."""

    def lease(self, req):
        reply = super().lease(req)
        return so.LeaseReply(reply.request_id, reply.status, reply.lease_id, reply.ttl_s, reply.sizes[:1])


def test_a_lease_with_fewer_sizes_than_keys_is_the_nodes_fault_and_lands_nothing():
    keys = [b"a" * 16, b"b" * 16]
    server = TcpTransport(TcpConfig(token=TOKEN)).serve("127.0.0.1:0", _ShortLease(dict.fromkeys(keys, b"x" * 64)))
    into = [bytearray(b"\xee" * 64) for _ in keys]
    try:
        with pytest.raises(ProtocolError, match="sizes do not match"):
            StoreNodeClient(server.address, token=TOKEN, timeout=10).read(keys, into)
        assert all(buf == b"\xee" * 64 for buf in into)  # before: the first landed, the second kept old bytes
    finally:
        server.close()


def test_a_peer_cannot_release_another_readers_lease_by_counting(node):
    """Lease ids are unguessable: a second authenticated peer that releases the ids next to its
    own (where a sequential counter put the first reader's) leaves the first reader's lease held."""
    keys, bufs = _keys(2, tag=5), _bufs(2)
    assert client(node.address).offer_and_push(keys, bufs).commit is ev.CommitStatus.COMMITTED
    transport = TcpTransport(TcpConfig(token=TOKEN.encode()))
    first, second = transport.connect(node.address), transport.connect(node.address)
    try:
        held = first.request(so.ReadLease(first.new_request_id(), tuple(keys), 600))
        mine = second.request(so.ReadLease(second.new_request_id(), tuple(keys), 600))
        assert held.status is mine.status is so.LeaseStatus.GRANTED
        for guess in (mine.lease_id - 1, mine.lease_id + 1, 1, 2):
            reply = second.request(so.Release(second.new_request_id(), guess))
            assert reply.status is ev.CommitStatus.FAILED
        into = bytearray(BLOCK)
        first.request(so.Pull(first.new_request_id(), held.lease_id, keys[0], 0, len(bufs[0])), into=into)
        assert bytes(into[: len(bufs[0])]) == bufs[0]
    finally:
        first.close()
        second.close()


def test_keys_under_lease_are_bounded_over_every_connection(monkeypatch):
    """Past MAX_LEASED_KEYS (3 here) a lease is refused CAPACITY whichever connection asks; a
    release makes room again, for a lease that names a key several times too."""
    from tiersync.net import store_node
    from tiersync.net.errors import RequestError

    monkeypatch.setattr(store_node, "MAX_LEASED_KEYS", 3)
    node = StoreNode(4 * BLOCK, BLOCK, config=TcpConfig(token=TOKEN.encode()))
    server = StoreNodeServer("127.0.0.1:0", node)
    transport = TcpTransport(TcpConfig(token=TOKEN.encode()))
    keys = _keys(2, tag=7)
    try:
        assert client(server.address).offer_and_push(keys, _bufs(2)).commit is ev.CommitStatus.COMMITTED
        a, b = transport.connect(server.address), transport.connect(server.address)
        first = a.request(so.ReadLease(a.new_request_id(), tuple(keys), 600))
        with pytest.raises(RequestError) as info:
            b.request(so.ReadLease(b.new_request_id(), tuple(keys), 600))
        assert info.value.code is ev.ErrorCode.CAPACITY and node.active_leases == 1
        a.request(so.Release(a.new_request_id(), first.lease_id))
        second = b.request(so.ReadLease(b.new_request_id(), tuple(keys), 600))
        assert second.status is so.LeaseStatus.GRANTED
        b.request(so.Release(b.new_request_id(), second.lease_id))
        for _ in range(2000):  # a key asked three times counts three while leased, and none after
            node.release(node.lease(so.ReadLease(1, (keys[0],) * 3, 600)).lease_id)
        assert node.lease(so.ReadLease(1, (keys[1],) * 3, 600)).status is so.LeaseStatus.GRANTED
        a.close()
        b.close()
    finally:
        server.close()
        node.close()


@pytest.mark.parametrize("kind", ["store-node", "memory"])
def test_lease_ids_are_random_63_bit_and_distinct(kind):
    from tiersync.net.source import new_lease_id

    if kind == "memory":
        source = MemoryBlockSource(dict.fromkeys(_keys(1), b"x" * 64))
        ids = [source.lease(so.ReadLease(1, tuple(_keys(1)))).lease_id for _ in range(300)]
    else:
        store = StoreNode(4 * BLOCK, BLOCK, config=TcpConfig(token=TOKEN.encode()))
        server = StoreNodeServer("127.0.0.1:0", store)
        try:
            assert client(server.address).offer_and_push(_keys(1), _bufs(1)).commit is ev.CommitStatus.COMMITTED
            ids = [store.lease(so.ReadLease(1, tuple(_keys(1)))).lease_id for _ in range(300)]
        finally:
            server.close()
            store.close()
    assert len(set(ids)) == 300 and all(0 < i < 2**63 for i in ids)
    assert not any(abs(a - b) < 2**32 for a, b in itertools.pairwise(ids))  # no counter: neighbours are far apart
    assert new_lease_id({5}) not in (0, 5)


def test_an_offer_whose_reply_cannot_be_written_frees_its_blocks_and_keys():
    """The node's write of an OFFER's reply fails (the writer reset its connection): the server
    closes the answer there (GeneratorExit at the reply). The blocks taken for the landing and
    the keys marked landing are freed; they were lost for good (every later OFFER of those keys
    was REFUSED, and enough such OFFERs filled the node). The keys are then stored as usual."""
    node = StoreNode(4 << 20, 1 << 20, config=TcpConfig(token=TOKEN.encode()))
    server = StoreNodeServer("127.0.0.1:0", node)
    try:
        writer_conn = type("Writer", (), {"peer": "127.0.0.1:40000"})()  # the session's address, all offer reads
        answers = node.offer(so.Offer(1, 7, (b"G" * 16,), (1 << 20,), ":1"), writer_conn)
        assert isinstance(next(answers), so.OfferReply) and node.free_blocks == 3
        answers.close()  # what the server does when the reply's write raised
        assert node.free_blocks == 4 and not node._landing
        data = os.urandom(1 << 20)
        StoreNodeClient(server.address, token=TOKEN.encode(), timeout=10.0).offer_and_push([b"G" * 16], [data])
        got = bytearray(1 << 20)
        client(server.address).read([b"G" * 16], [got])
        assert got == data
    finally:
        server.close()
        node.close()
