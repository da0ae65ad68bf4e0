"""What every block server (tiersync.net.source.BlockService) bounds per connection, against a
real server process."""

from __future__ import annotations

import multiprocessing

import pytest

from _peer import TOKEN, run_block_server, wait_until
from tiersync.net import events as ev
from tiersync.net import store_ops as so
from tiersync.net.errors import RequestError
from tiersync.net.source import MAX_SESSION_LEASES
from tiersync.net.tcp import TcpConfig, TcpTransport

KEY = b"L" * 16


@pytest.fixture(scope="module")
def served():
    ctx = multiprocessing.get_context("spawn")
    address_q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=run_block_server, args=(TcpConfig(token=TOKEN), {KEY: b"x" * 4096}, address_q, stop))
    proc.start()
    try:
        yield address_q.get(timeout=30)
    finally:
        stop.set()
        proc.join(10)


def test_one_connection_holds_a_bounded_number_of_leases(served):
    """Each lease pins its blocks until released: one connection gets MAX_SESSION_LEASES, the
    next is refused CAPACITY on a session that goes on, and a release makes room again."""
    ch = TcpTransport(TcpConfig(token=TOKEN)).connect(served)
    try:
        asks = [(so.ReadLease(ch.new_request_id(), (KEY,), 600), None) for _ in range(MAX_SESSION_LEASES)]
        granted: list[int] = []
        ch.pipeline(asks, window=64, landed=lambda _, reply: granted.append(reply.lease_id))
        assert len(set(granted)) == MAX_SESSION_LEASES
        with pytest.raises(RequestError) as info:
            ch.request(so.ReadLease(ch.new_request_id(), (KEY,), 600))
        assert info.value.code is ev.ErrorCode.CAPACITY and not ch.closed
        assert ch.request(so.Release(ch.new_request_id(), granted[0])).status is ev.CommitStatus.COMMITTED
        assert ch.request(so.ReadLease(ch.new_request_id(), (KEY,), 600)).status is so.LeaseStatus.GRANTED
    finally:
        ch.close()


def test_leases_past_their_ttl_no_longer_count_against_the_cap():
    """A connection whose MAX_SESSION_LEASES leases all ended by their TTL (a server clock 200x
    real time: 30 s in 0.15 s) is granted the next lease, not refused CAPACITY."""
    ctx = multiprocessing.get_context("spawn")
    address_q, stop = ctx.Queue(), ctx.Event()
    args = (TcpConfig(token=TOKEN), {KEY: b"x" * 4096}, address_q, stop, 200.0)
    proc = ctx.Process(target=run_block_server, args=args)
    proc.start()
    ch = None
    try:
        ch = TcpTransport(TcpConfig(token=TOKEN)).connect(address_q.get(timeout=30))
        asks = [(so.ReadLease(ch.new_request_id(), (KEY,), 30), None) for _ in range(MAX_SESSION_LEASES)]
        granted: list[int] = []
        ch.pipeline(asks, window=64, landed=lambda _, reply: granted.append(reply.lease_id))
        assert len(set(granted)) == MAX_SESSION_LEASES

        def ended() -> bool:
            try:
                ch.request(so.Pull(ch.new_request_id(), granted[-1], KEY, 0, 16))
            except RequestError as exc:
                return exc.code is ev.ErrorCode.LEASE_EXPIRED
            return False

        assert wait_until(ended)
        assert ch.request(so.ReadLease(ch.new_request_id(), (KEY,), 30)).status is so.LeaseStatus.GRANTED
    finally:
        if ch is not None:
            ch.close()
        stop.set()
        proc.join(10)


def test_a_lease_past_its_ttl_counted_out_at_the_cap_is_also_forgotten_by_the_server():
    """Pruning the connection's ended leases at the cap also releases them in the block server:
    an in-memory server kept every expired lease's record (``active_leases`` grew past the cap)."""
    import time

    from tiersync.net.source import MemoryBlockSource

    source = MemoryBlockSource({KEY: b"x" * 4096}, clock=lambda: time.monotonic() * 200.0)
    server = TcpTransport(TcpConfig(token=TOKEN)).serve("127.0.0.1:0", source)
    ch = TcpTransport(TcpConfig(token=TOKEN)).connect(server.address)
    try:
        asks = [(so.ReadLease(ch.new_request_id(), (KEY,), 30), None) for _ in range(MAX_SESSION_LEASES)]
        granted: list[int] = []
        ch.pipeline(asks, window=64, landed=lambda _, reply: granted.append(reply.lease_id))
        assert source.active_leases == MAX_SESSION_LEASES
        assert wait_until(lambda: not source.holds(granted[-1]))  # the last granted ended: all did
        assert ch.request(so.ReadLease(ch.new_request_id(), (KEY,), 30)).status is so.LeaseStatus.GRANTED
        assert source.active_leases == 1
    finally:
        ch.close()
        server.close()


def test_a_pull_larger_than_the_peers_frames_is_refused_before_any_block_is_read():
    """A reader that takes 1 MiB frames asks 4 MiB in one PULL_MANY: answered BAD_REQUEST
    naming the frame size, and the server read no block for it (no view, nothing summed)."""
    from tiersync.net.config import Route
    from tiersync.net.frames import ProtocolConfig
    from tiersync.net.source import MemoryBlockSource

    class Counting(MemoryBlockSource):
        reads = 0

        def views(self, lease_id, items):
            Counting.reads += 1
            return super().views(lease_id, items)

    keys = [bytes([i]) * 16 for i in range(64)]
    server = TcpTransport(TcpConfig(token=TOKEN)).serve("127.0.0.1:0", Counting(dict.fromkeys(keys, bytes(64 << 10))))
    mib = TcpConfig(token=TOKEN, route=Route.TCP, protocol=ProtocolConfig(max_frame_size=1 << 20))
    ch = TcpTransport(mib).connect(server.address)
    try:
        lease = ch.request(so.ReadLease(ch.new_request_id(), tuple(keys))).lease_id
        with pytest.raises(RequestError, match="max_frame_size") as info:
            ch.request(so.PullMany(ch.new_request_id(), lease, tuple((k, 0, 64 << 10) for k in keys)))
        assert info.value.code is ev.ErrorCode.BAD_REQUEST and Counting.reads == 0 and not ch.closed
    finally:
        ch.close()
        server.close()


def test_a_pull_local_of_many_ranges_past_a_frame_is_refused_before_any_range_is_summed():
    """Each range of a PULL_LOCAL that is not a whole block is summed for the answer: 4096
    ranges of one 1 MiB block (a 131 KB request) made the server sum 4 GiB. Several ranges past
    the frame both ends accept are now refused UNSUPPORTED with nothing read (a reader on route
    AUTO that grouped them, as older ones did, reads over TCP instead); one range (at most its
    block) and several within a frame are answered."""
    from tiersync.net.local import refusal
    from tiersync.net.source import MemoryBlockSource

    class Counting(MemoryBlockSource):
        reads = 0

        def views(self, lease_id, items):
            Counting.reads += 1
            return super().views(lease_id, items)

    server = TcpTransport(TcpConfig(token=TOKEN)).serve("127.0.0.1:0", Counting({KEY: bytes(1 << 20)}))
    ch = TcpTransport(TcpConfig(token=TOKEN)).connect(server.address)
    try:
        assert ch.info.same_host and ch.info.max_frame == 64 << 20
        lease = ch.request(so.ReadLease(ch.new_request_id(), (KEY,))).lease_id
        with pytest.raises(RequestError, match="max_frame_size") as info:
            ch.request(so.PullLocal(ch.new_request_id(), lease, ((KEY, 1, (1 << 20) - 1),) * 4096))
        assert info.value.code is ev.ErrorCode.UNSUPPORTED and Counting.reads == 0 and not ch.closed
        assert refusal(info.value, ch.peer) is not None  # what makes route AUTO fall back to TCP
        one = ch.request(so.PullLocal(ch.new_request_id(), lease, ((KEY, 1, (1 << 20) - 1),)))
        many = ch.request(so.PullLocal(ch.new_request_id(), lease, ((KEY, 1, (1 << 20) - 1),) * 64))
        assert isinstance(one, ev.LocalReply) and isinstance(many, ev.LocalReply) and Counting.reads == 2
    finally:
        ch.close()
        server.close()


@pytest.mark.parametrize("kind", ["store-node", "memory"])
def test_only_a_server_with_private_memory_lets_same_host_readers_trace_it(kind, monkeypatch):
    """prctl(PR_SET_PTRACER_ANY) lets every same-uid process trace the server where Yama asks:
    only worth it for memory readers copy with process_vm_readv, and only once one does. A
    same-host session that reads nothing (a PING) leaves every server as it was; a PULL_LOCAL
    of a store node's shareable arena too (it is mapped instead); one of a source of private
    blocks asks."""
    from tiersync.net import local
    from tiersync.net.source import MemoryBlockSource
    from tiersync.net.store_node import StoreNode, StoreNodeServer

    asked: list[bool] = []
    if kind == "store-node":
        node = StoreNode(1 << 20, 4096, config=TcpConfig(token=TOKEN))
        if not node.shared:
            node.close()
            pytest.skip("no shareable memory (memfd) on this host")
        server, closing = StoreNodeServer("127.0.0.1:0", node), node
    else:
        server, closing = (
            TcpTransport(TcpConfig(token=TOKEN)).serve("127.0.0.1:0", MemoryBlockSource({KEY: b"x"})),
            None,
        )
    try:
        if kind == "store-node":  # the node reads the writer (this process) on the same host
            from tiersync.net.store_node import StoreNodeClient

            StoreNodeClient(server.address, token=TOKEN).offer_and_push([KEY], [b"x"])
        monkeypatch.setattr(local, "allow_readers", lambda: asked.append(True))
        ch = TcpTransport(TcpConfig(token=TOKEN)).connect(server.address)
        assert ch.info.same_host
        assert ch.request(ev.Ping(ch.new_request_id())) is not None  # the session is open on the server
        assert asked == []
        lease = ch.request(so.ReadLease(ch.new_request_id(), (KEY,))).lease_id
        assert isinstance(ch.request(so.PullLocal(ch.new_request_id(), lease, ((KEY, 0, 1),))), ev.LocalReply)
        ch.close()
        assert asked == ([] if kind == "store-node" else [True])
    finally:
        server.close()
        if closing is not None:
            closing.close()


def test_a_closed_sessions_leases_are_each_released_even_when_one_release_fails(monkeypatch):
    """A session ends holding two leases and releasing the first one raises: the second is
    released all the same (it stayed pinned until its TTL, counted against the caps)."""
    from tiersync.net.source import MemoryBlockSource

    class Peer:  # what the service reads of a session (a server session, here without a socket)
        peer, closed = "127.0.0.1:1", False

    source = MemoryBlockSource({KEY: b"x" * 4096})
    session = Peer()
    for rid in (1, 2):
        reply = source.handle(session, so.ReadLease(rid, (KEY,)))
        assert [r.status for r in reply] == [so.LeaseStatus.GRANTED]
    assert source.session_leases() == 2
    real, failed = source.release, []

    def release(lease_id: int) -> bool:
        if not failed:
            failed.append(lease_id)
            raise OSError(24, "Too many open files")
        return real(lease_id)

    monkeypatch.setattr(source, "release", release)
    source.closed(session)
    assert len(failed) == 1 and source.session_leases() == 0
    assert len(source._leases) == 1  # only the one whose release raised waits for its TTL


def test_keys_under_lease_are_bounded_over_every_connection(monkeypatch):
    """Each connection may hold MAX_SESSION_LEASES leases, but connections add up: past
    MAX_LEASED_KEYS (3 here) keys under lease, a lease is refused CAPACITY whichever connection
    asks; a release, or the end of a lease's TTL, makes room again."""
    from tiersync.net import source as source_mod
    from tiersync.net.source import MemoryBlockSource

    monkeypatch.setattr(source_mod, "MAX_LEASED_KEYS", 3)
    now = [0.0]
    keys = (b"a" * 16, b"b" * 16)
    source = MemoryBlockSource(dict.fromkeys(keys, b"x" * 64), clock=lambda: now[0])
    server = TcpTransport(TcpConfig(token=TOKEN)).serve("127.0.0.1:0", source)
    one, two = (TcpTransport(TcpConfig(token=TOKEN)).connect(server.address) for _ in range(2))
    try:
        held = one.request(so.ReadLease(one.new_request_id(), keys, 30)).lease_id
        with pytest.raises(RequestError) as info:
            two.request(so.ReadLease(two.new_request_id(), keys, 30))
        assert info.value.code is ev.ErrorCode.CAPACITY and not two.closed
        assert one.request(so.Release(one.new_request_id(), held)).status is ev.CommitStatus.COMMITTED
        assert two.request(so.ReadLease(two.new_request_id(), keys, 30)).status is so.LeaseStatus.GRANTED
        now[0] = 31.0  # that lease's TTL ended: forgotten at the cap
        assert one.request(so.ReadLease(one.new_request_id(), keys, 30)).status is so.LeaseStatus.GRANTED
        assert source.active_leases == 1
    finally:
        one.close()
        two.close()
        server.close()
