"""TCP transport between real processes on 127.0.0.1 (spawned servers, no sleeps)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import types

import pytest

from _peer import block_server, wait_until
from tiersync.errors import ClosedError, UsageError
from tiersync.net import events as ev
from tiersync.net import store_ops as so
from tiersync.net.errors import AuthError, NetTimeoutError, PeerClosedError, RequestError
from tiersync.net.frames import SUPPORTED, PayloadChecksum
from tiersync.net.pool import ChannelPool
from tiersync.net.source import MemoryBlockSource
from tiersync.net.tcp import TcpConfig, TcpTransport
from tiersync.net.tls import TlsConfig

TOKEN = b"t" * 32
BIG, SMALL = b"B" * 16, b"S" * 16
BLOCKS = {BIG: os.urandom(6 << 20), SMALL: b"hello world"}


def server_process(config: TcpConfig, address: str = "127.0.0.1:0"):
    return block_server(config, BLOCKS, address)


@pytest.fixture(scope="module")
def peer():
    # A small send buffer on the server forces partial sendmsg calls.
    with server_process(TcpConfig(token=TOKEN, sndbuf=64 << 10)) as address:
        yield address


def test_lease_pull_release_across_processes_is_byte_exact(peer):
    transport = TcpTransport(TcpConfig(token=TOKEN))
    channel = transport.connect(peer)
    lease = channel.request(so.ReadLease(channel.new_request_id(), (BIG, SMALL)))
    assert lease.status is so.LeaseStatus.GRANTED and lease.sizes == (len(BLOCKS[BIG]), 11)
    dest = bytearray(lease.sizes[0])
    data = channel.request(so.Pull(channel.new_request_id(), lease.lease_id, BIG, 0, len(dest)), into=memoryview(dest))
    assert data.payload.obj is dest and dest == BLOCKS[BIG]
    small = channel.request(so.Pull(channel.new_request_id(), lease.lease_id, SMALL, 6, 5))
    assert bytes(small.payload) == b"world"
    done = channel.request(so.Release(channel.new_request_id(), lease.lease_id))
    assert done.status is ev.CommitStatus.COMMITTED
    again = channel.request(so.Release(channel.new_request_id(), lease.lease_id))
    assert again.status is ev.CommitStatus.FAILED  # lease no longer held: no commit
    channel.close()


def test_striped_pull_over_several_streams_and_pool_reuse(peer):
    from tiersync.net.config import Route

    pool = ChannelPool(TcpTransport(TcpConfig(token=TOKEN, route=Route.TCP)), max_idle_per_peer=8)
    with pool.acquire(peer) as channel:
        lease = channel.request(so.ReadLease(channel.new_request_id(), (BIG,)))
    first = channel
    dest = bytearray(len(BLOCKS[BIG]))
    _pull_striped(pool, peer, lease.lease_id, memoryview(dest), 4)
    assert dest == BLOCKS[BIG]
    # Four parts ran on pooled channels; a part that starts after another finished
    # reuses its channel, so 1..4 distinct channels, all returned to the pool.
    assert 1 <= pool.idle_count(peer) <= 4
    with pool.acquire(peer) as channel:
        assert not channel.closed
        assert channel.request(ev.Ping(channel.new_request_id(), 9)).token == 9
    assert first in [c for _, c in pool._idle[peer]]
    pool.close()
    assert first.closed


def test_a_pooled_channel_whose_server_restarted_is_not_handed_out_again():
    """A server restarted on the same port hung up the pool's idle channels: the next acquire
    closes them and connects anew, so no request fails on a dead connection."""
    pool = ChannelPool(TcpTransport(TcpConfig(token=TOKEN)))
    with server_process(TcpConfig(token=TOKEN)) as address:
        with pool.acquire(address) as first, pool.acquire(address) as second:
            assert first.request(ev.Ping(first.new_request_id(), 1)).token == 1
        assert pool.idle_count(address) == 2
    with server_process(TcpConfig(token=TOKEN), address) as again:
        assert again == address
        with pool.acquire(address) as channel:
            assert channel not in (first, second)
            assert channel.request(ev.Ping(channel.new_request_id(), 2)).token == 2
        assert first.closed and second.closed and pool.idle_count(address) == 1
    pool.close()


def test_channels_idle_past_max_idle_s_are_closed_and_their_peer_forgotten(peer, monkeypatch):
    """An idle channel older than ``max_idle_s`` is not handed out; once the pool is used again
    (for any peer) the peers idle that long are closed and forgotten."""
    import time as time_module

    from tiersync.net import pool as pool_module

    now = [time_module.monotonic()]
    monkeypatch.setattr(pool_module, "time", types.SimpleNamespace(monotonic=lambda: now[0]))  # the pool's clock only
    pool = ChannelPool(TcpTransport(TcpConfig(token=TOKEN)), max_idle_s=10.0)
    with pool.acquire(peer) as old:
        pass
    now[0] += 11
    with pool.acquire(peer) as channel:
        assert channel is not old and old.closed
    assert pool.idle_count(peer) == 1 and pool.peers() == 1
    now[0] += 11
    with server_process(TcpConfig(token=TOKEN)) as other:
        with pool.acquire(other):
            pass
        assert channel.closed and pool.idle_count(peer) == 0 and pool.peers() == 1
        pool.close()
    with pytest.raises(UsageError, match="max_idle_s"):
        ChannelPool(TcpTransport(TcpConfig(token=TOKEN)), max_idle_s=0)


def test_missing_key_and_bad_range_answers(peer):
    channel = TcpTransport(TcpConfig(token=TOKEN)).connect(peer)
    reply = channel.request(so.ReadLease(channel.new_request_id(), (SMALL, b"?" * 16)))
    assert reply.status is so.LeaseStatus.MISSING and reply.missing == (b"?" * 16,)
    lease = channel.request(so.ReadLease(channel.new_request_id(), (SMALL,)))
    with pytest.raises(RequestError) as info:
        channel.request(so.Pull(channel.new_request_id(), lease.lease_id, SMALL, 5, 100))
    assert info.value.code is ev.ErrorCode.BAD_REQUEST and info.value.peer == peer
    assert channel.request(ev.Ping(channel.new_request_id())).request_id  # channel still usable
    channel.close()


@pytest.mark.parametrize("token", [None, b"w" * 32])
def test_peer_without_the_token_is_refused(peer, token):
    with pytest.raises(AuthError) as info:
        TcpTransport(TcpConfig(token=token)).connect(peer)
    assert info.value.peer == peer


def test_server_without_the_token_is_refused_by_the_client():
    server = TcpTransport(TcpConfig()).serve("127.0.0.1:0", MemoryBlockSource({}))
    try:
        with pytest.raises(AuthError):
            TcpTransport(TcpConfig(token=TOKEN)).connect(server.address)
    finally:
        server.close()


def test_deadline_names_the_peer():
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (backlog) but never answers
    address = f"127.0.0.1:{silent.getsockname()[1]}"
    try:
        with pytest.raises(NetTimeoutError) as info:
            TcpTransport(TcpConfig(connect_timeout_s=0.3)).connect(address)
        assert info.value.peer == address and isinstance(info.value, TimeoutError)
    finally:
        silent.close()


def test_server_going_away_fails_requests_cleanly():
    server = TcpTransport(TcpConfig()).serve("127.0.0.1:0", MemoryBlockSource({}))
    channel = TcpTransport(TcpConfig()).connect(server.address)
    server.close()
    with pytest.raises(PeerClosedError):
        channel.request(ev.Ping(channel.new_request_id()))
    assert channel.closed


def test_garbage_from_one_client_does_not_hurt_others():
    server = TcpTransport(TcpConfig()).serve("127.0.0.1:0", MemoryBlockSource({SMALL: b"x"}))
    host, port = server.address.split(":")
    try:
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            raw.sendall(os.urandom(200))
            raw.settimeout(5)
            assert raw.recv(100) == b""  # server hung up on the bad peer
        channel = TcpTransport(TcpConfig()).connect(server.address)
        assert channel.request(ev.Ping(channel.new_request_id(), 3)).token == 3
        channel.close()
    finally:
        server.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    pytest.importorskip("cryptography")
    from _certs import make_ca, make_leaf

    d = tmp_path_factory.mktemp("pki")
    ca, rogue = make_ca(d), make_ca(d, "rogue-ca")
    return {
        "ca": ca[2],
        "server": make_leaf(d, ca, "server"),
        "client": make_leaf(d, ca, "client"),
        "rogue": make_leaf(d, rogue, "rogue"),
        "rogue_ca": rogue[2],
    }


def test_mutual_tls_with_token_across_processes(pki):
    cert, key = pki["server"]
    server_cfg = TcpConfig(token=TOKEN, tls=TlsConfig(pki["ca"], cert, key, require_peer_cert=True))
    with server_process(server_cfg) as address:
        ccert, ckey = pki["client"]
        good = TcpTransport(TcpConfig(token=TOKEN, tls=TlsConfig(pki["ca"], ccert, ckey)))
        channel = good.connect(address)
        lease = channel.request(so.ReadLease(channel.new_request_id(), (BIG,)))
        dest = bytearray(lease.sizes[0])
        channel.request(so.Pull(channel.new_request_id(), lease.lease_id, BIG, 0, len(dest)), into=memoryview(dest))
        assert dest == BLOCKS[BIG]
        channel.close()
        no_cert = TcpTransport(TcpConfig(token=TOKEN, tls=TlsConfig(pki["ca"])))
        with pytest.raises((AuthError, PeerClosedError)):
            no_cert.connect(address)
        rcert, rkey = pki["rogue"]
        with pytest.raises((AuthError, PeerClosedError)):
            TcpTransport(TcpConfig(token=TOKEN, tls=TlsConfig(pki["ca"], rcert, rkey))).connect(address)
        with pytest.raises(AuthError):  # client does not trust the server's CA
            TcpTransport(TcpConfig(token=TOKEN, tls=TlsConfig(pki["rogue_ca"], ccert, ckey))).connect(address)


def test_a_tls_session_ended_from_another_thread_keeps_its_tls_state(pki, monkeypatch):
    """``SSLSocket.shutdown`` drops the TLS object before it shuts the socket, and an SSLSocket
    without one sends plaintext: a worker answering while another thread ended the session
    could put KV or weight bytes on the wire unencrypted. The server shuts the plain socket
    instead (never ``SSLSocket.shutdown``); the session's TLS state stays until the socket is
    closed."""
    import ssl
    import threading as _threading

    shut: list[object] = []
    real_shutdown = ssl.SSLSocket.shutdown
    monkeypatch.setattr(ssl.SSLSocket, "shutdown", lambda sock, how: shut.append(sock) or real_shutdown(sock, how))

    from tiersync.net.service import Service

    opened, ended = _threading.Event(), _threading.Event()
    sessions = []

    class Keep(Service):
        vocabulary = MemoryBlockSource({}).vocabulary

        def handle(self, session, event):
            return [ev.Pong(event.request_id, event.token)]

        def opened(self, session):
            sessions.append(session)
            opened.set()

        def closed(self, session):
            ended.set()

    cert, key = pki["server"]
    server = TcpTransport(TcpConfig(token=TOKEN, tls=TlsConfig(pki["ca"], cert, key))).serve("127.0.0.1:0", Keep())
    client = TcpTransport(TcpConfig(token=TOKEN, tls=TlsConfig(pki["ca"]))).connect(server.address)
    try:
        assert client.request(ev.Ping(client.new_request_id(), 3)).token == 3 and opened.wait(5)
        session = sessions[0]
        session.close()  # from this thread, not the server's
        assert ended.wait(5) and wait_until(lambda: session.sock.fileno() == -1)  # shut, then released
        assert session.sock not in shut
    finally:
        client.close()
        server.close()


def test_a_tls_connection_over_the_cap_is_closed_not_answered_in_plaintext(pki):
    """Over its connection cap a TLS server used to write its plaintext refusal into the
    client's TLS handshake, which the client read as "wrong version number". It now closes
    the connection, and the client's AuthError names both likely causes (a peer that does not
    speak TLS, far more common, stays an AuthError: final for the callers that branch on it);
    the server goes on serving."""
    cert, key = pki["server"]
    cfg = TcpConfig(token=TOKEN, tls=TlsConfig(pki["ca"], cert, key), max_connections=1)
    server = TcpTransport(cfg).serve("127.0.0.1:0", MemoryBlockSource({}))
    client = TcpTransport(TcpConfig(token=TOKEN, tls=TlsConfig(pki["ca"])))
    first = client.connect(server.address)
    try:
        for _ in range(3):
            with pytest.raises((AuthError, PeerClosedError)) as info:  # EOF, or a reset
                client.connect(server.address, timeout=5)
            assert "version number" not in str(info.value)
        assert first.request(ev.Ping(first.new_request_id(), 5)).token == 5
        assert server.refused == 3
    finally:
        first.close()
        server.close()


def test_a_tls_client_of_a_plaintext_server_gets_an_auth_error(pki):
    """The server closes on the TLS ClientHello (not a frame): the client's error is an
    AuthError (a setting to fix, which callers such as a weights sampler report and stop on),
    not a PeerClosedError they would retry quietly."""
    server = TcpTransport(TcpConfig(token=TOKEN)).serve("127.0.0.1:0", MemoryBlockSource({}))
    try:
        for _ in range(3):
            with pytest.raises(AuthError, match="TLS"):
                TcpTransport(TcpConfig(token=TOKEN, tls=TlsConfig(pki["ca"]))).connect(server.address, timeout=5)
    finally:
        server.close()


def test_a_pooled_tls_channel_is_handed_out_again_and_a_stale_one_is_not(pki):
    """Over TLS, an idle channel the server did not close is reused (records the peer sent
    after the handshake are no stray bytes); once the server is gone it is not."""
    cert, key = pki["server"]
    pool = ChannelPool(TcpTransport(TcpConfig(token=TOKEN, tls=TlsConfig(pki["ca"]))))
    with server_process(TcpConfig(token=TOKEN, tls=TlsConfig(pki["ca"], cert, key))) as address:
        for token in (1, 2):
            with pool.acquire(address) as channel:
                assert channel.request(ev.Ping(channel.new_request_id(), token)).token == token
            if token == 1:
                first = channel
        assert channel is first and not first.closed
    assert not first.reusable()  # the server process is gone
    pool.close()


def _pull_every_block(transport, server, blocks):
    """Lease every block of ``server`` and pull_many them into buffers of their own, byte-exact;
    the channel and the lease id."""
    from tiersync.net import store_ops as so

    ch = transport.connect(server.address)
    lease = ch.request(so.ReadLease(ch.new_request_id(), tuple(blocks), ttl_s=60)).lease_id
    dests = {k: memoryview(bytearray(len(v))) for k, v in blocks.items()}
    ch.pull_many(lease, [(k, 0, d) for k, d in dests.items()], window=4)
    assert all(bytes(dests[k]) == v for k, v in blocks.items())
    return ch, lease


@pytest.mark.parametrize("route", ["tcp", "local"])
def test_pull_many_pipelines_into_each_destination(route):
    """pull_many keeps several PULLs in flight (small ones grouped into PULL_MANY, or the
    same-host route); every payload lands byte-exact in its own buffer."""
    from tiersync.net.source import MemoryBlockSource
    from tiersync.net.tcp import Route, TcpTransport

    blocks = {bytes([i]) * 16: bytes([i]) * (1000 + i) for i in range(20)}
    transport = TcpTransport(TcpConfig(route=Route(route)))
    server = transport.serve("127.0.0.1:0", MemoryBlockSource(blocks))
    try:
        ch, lease = _pull_every_block(transport, server, blocks)
        from tiersync.net.errors import RequestError

        with pytest.raises(RequestError):  # a key not under the lease: an ERROR answer
            ch.pull_many(lease, [(b"\xee" * 16, 0, memoryview(bytearray(8)))], window=2)
        assert ch.closed == (route == "tcp")  # TCP: later answers may be in flight, so the channel closes
    finally:
        server.close()


def test_pull_many_groups_stay_within_a_lowered_max_frame_size():
    """A connection whose frames are capped below GROUP_LIMIT still pulls many small blocks:
    each group's answer fits the cap (with 1 MiB of blocks per frame, 8 x 512 KiB pass)."""
    from tiersync.net.frames import ProtocolConfig
    from tiersync.net.source import MemoryBlockSource
    from tiersync.net.tcp import Route, TcpTransport

    blocks = {bytes([i]) * 16: os.urandom(512 << 10) for i in range(8)}
    transport = TcpTransport(TcpConfig(route=Route.TCP, protocol=ProtocolConfig(max_frame_size=(1 << 20) + 4096)))
    server = transport.serve("127.0.0.1:0", MemoryBlockSource(blocks))
    try:
        _pull_every_block(transport, server, blocks)
    finally:
        server.close()


@pytest.mark.parametrize("capped", ["server", "client"])
def test_neither_end_is_sent_a_frame_larger_than_it_accepts(capped):
    """The handshake tells each end the other's max_frame_size (PeerInfo keeps the lesser).
    pull_many keeps every answer within it (the 6 MiB block in 1 MiB parts), byte-exact; a single PULL
    over it is answered ERROR naming the frame size (the server does not send a frame the
    client would refuse, nor refuse one it was asked for), and the channel keeps working."""
    from tiersync.net.frames import ProtocolConfig
    from tiersync.net.tcp import Route

    mib = ProtocolConfig(max_frame_size=1 << 20)
    server = TcpConfig(token=TOKEN, protocol=mib) if capped == "server" else TcpConfig(token=TOKEN)
    client = TcpConfig(token=TOKEN, route=Route.TCP, **({"protocol": mib} if capped == "client" else {}))
    with server_process(server) as address:
        ch = TcpTransport(client).connect(address)
        assert ch.info.max_frame == 1 << 20  # the lesser of the two ends' max_frame_size
        lease = ch.request(so.ReadLease(ch.new_request_id(), (BIG, SMALL))).lease_id
        for _ in range(2):  # the refused PULL in between leaves the channel usable
            big, small = bytearray(len(BLOCKS[BIG])), bytearray(11)
            ch.pull_many(lease, [(BIG, 0, memoryview(big)), (SMALL, 0, memoryview(small))], window=4)
            assert big == BLOCKS[BIG] and small == BLOCKS[SMALL]
            with pytest.raises(RequestError, match="max_frame_size"):
                pull = so.Pull(ch.new_request_id(), lease, BIG, 0, 2 << 20)
                ch.request(pull, into=memoryview(bytearray(2 << 20)))
            assert not ch.closed
        ch.close()
        pool, striped = ChannelPool(TcpTransport(client)), bytearray(len(BLOCKS[BIG]))
        lease = _lease_big(pool, address)
        _pull_striped(pool, address, lease, memoryview(striped), 2)  # two 3 MiB parts
        assert striped == BLOCKS[BIG]
        pool.close()


def _pull_striped(pool: ChannelPool, address: str, lease: int, dest: memoryview, parts: int) -> None:
    """Block BIG into ``dest`` in ``parts`` equal ranges, each on a pooled channel of its own thread."""
    step = -(-len(dest) // parts)

    def one(offset: int) -> None:
        with pool.acquire(address) as channel:
            channel.pull_many(lease, [(BIG, offset, dest[offset : offset + step])])

    threads = [threading.Thread(target=one, args=(o,)) for o in range(0, len(dest), step)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)


def _lease_big(pool: ChannelPool, address: str) -> int:
    with pool.acquire(address) as channel:
        return channel.request(so.ReadLease(channel.new_request_id(), (BIG,))).lease_id


class _Interrupted(Exception):
    pass


def test_an_exception_between_a_request_and_its_answer_closes_the_channel():
    """A signal handler that raises while a request waits for its answer: the answer still
    comes later, so the channel closes (a next request must not read it as its own)."""
    import signal

    from tiersync.net.service import Service
    from tiersync.net.vocab import Vocabulary

    release = threading.Event()

    class Slow(Service):
        vocabulary = Vocabulary("slow", {}, include=(ev.CORE,))

        def handle(self, session, event):
            release.wait(10)
            return [ev.Pong(event.request_id, event.token)]

    def interrupt(*_):
        raise _Interrupted

    transport = TcpTransport(TcpConfig(token=TOKEN), Slow.vocabulary)
    server = transport.serve("127.0.0.1:0", Slow())
    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        ch = transport.connect(server.address)
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(_Interrupted):
            ch.request(ev.Ping(ch.new_request_id(), 1), timeout=10)
        release.set()
        assert ch.closed
        with pytest.raises(ClosedError):
            ch.request(ev.Ping(ch.new_request_id(), 2))
        ch = transport.connect(server.address)  # the server serves on
        assert ch.request(ev.Ping(ch.new_request_id(), 3)).token == 3
        ch.close()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        release.set()
        server.close()


def test_the_error_of_another_request_is_not_taken_as_this_ones():
    """An ERROR that answers an earlier request (sent with send_many, its answer not read)
    arrives while a later request waits: a protocol error that closes the channel, not a
    RequestError for the later request (whose own answer would then wait unread)."""
    from tiersync.errors import RemoteError
    from tiersync.net.errors import ProtocolError
    from tiersync.net.service import Service
    from tiersync.net.vocab import Vocabulary

    class Picky(Service):
        vocabulary = Vocabulary("picky", {}, include=(ev.CORE,))

        def handle(self, session, event):
            if event.token == 1:
                raise RemoteError("token 1 refused")
            return [ev.Pong(event.request_id, event.token)]

    transport = TcpTransport(TcpConfig(token=TOKEN), Picky.vocabulary)
    server = transport.serve("127.0.0.1:0", Picky())
    try:
        ch = transport.connect(server.address)
        ch.send_many([ev.Ping(ch.new_request_id(), 1)])
        with pytest.raises(ProtocolError, match="out-of-turn ERROR"):
            ch.request(ev.Ping(ch.new_request_id(), 2), timeout=10)
        assert ch.closed
    finally:
        server.close()


def test_a_server_that_refuses_same_host_reads_gets_them_over_tcp():
    """The client counts the server as on this host, the server does not (NAT, a redirect):
    its UNSUPPORTED answers to PULL_LOCAL (two groups in flight) make route AUTO fall back to
    TCP for this channel, byte-exact, instead of failing the pull."""
    from tiersync.net.service import Service
    from tiersync.net.tcp import Route

    blocks = {bytes([i]) * 16: os.urandom(1 << 20) for i in range(6)}
    inner = MemoryBlockSource(blocks)

    class NotSameHost(Service):
        vocabulary = inner.vocabulary

        def handle(self, session, event):
            if isinstance(event, so.PullLocal):
                return [ev.Error(event.request_id, ev.ErrorCode.UNSUPPORTED, "PULL_LOCAL from another host")]
            return inner.handle(session, event)

        def closed(self, session):
            inner.closed(session)

    transport = TcpTransport(TcpConfig(token=TOKEN, route=Route.AUTO))
    server = transport.serve("127.0.0.1:0", NotSameHost())
    try:
        ch = transport.connect(server.address)
        assert ch.local_route()
        lease = ch.request(so.ReadLease(ch.new_request_id(), tuple(blocks), ttl_s=60)).lease_id
        dests = {k: memoryview(bytearray(len(v))) for k, v in blocks.items()}
        ch.pull_many(lease, [(k, 0, d) for k, d in dests.items()], window=4)
        assert all(bytes(dests[k]) == v for k, v in blocks.items())
        assert not ch.local_route() and not ch.closed
        ch.close()
    finally:
        server.close()


# -- builds with and without the native checksum talk to each other -------------------------------
_FALLBACK_PEER = r"""
import sys
sys.modules["tiersync.transfer._kernel"] = None  # this process is a build without the extension
from tiersync.net import events as ev
from tiersync.net import store_ops as so
from tiersync.net.frames import SUPPORTED
from tiersync.net.source import MemoryBlockSource
from tiersync.net.tcp import TcpTransport
assert [a.name for a in SUPPORTED] == ["XXH3_64"]
block = bytes(range(256)) * 8192
if sys.argv[1] == "serve":
    server = TcpTransport().serve("127.0.0.1:0", MemoryBlockSource({b"F" * 16: block}))
    print("listening", server.address, flush=True)
    sys.stdin.read()
    server.close()
else:
    ch = TcpTransport().connect(sys.argv[2])
    lease = ch.request(so.ReadLease(ch.new_request_id(), (b"N" * 16,)))
    dest = bytearray(lease.sizes[0])
    ch.request(so.Pull(ch.new_request_id(), lease.lease_id, b"N" * 16, 0, len(dest)), into=memoryview(dest))
    print("algo", ch.payload_checksum.name, "exact", dest == block, flush=True)
"""


def _fallback(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _FALLBACK_PEER, *args], stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True, **kw
    )


def test_a_native_server_and_a_fallback_client_agree_on_xxh3():
    block = bytes(range(256)) * 8192
    server = TcpTransport().serve("127.0.0.1:0", MemoryBlockSource({b"N" * 16: block}))
    try:
        proc = _fallback("pull", server.address)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and out.split() == ["algo", "XXH3_64", "exact", "True"]
    finally:
        server.close()


def test_a_native_client_and_a_fallback_server_agree_on_xxh3():
    proc = _fallback("serve")
    try:
        address = proc.stdout.readline().split()[1]
        ch = TcpTransport().connect(address)
        assert ch.payload_checksum is PayloadChecksum.XXH3_64
        lease = ch.request(so.ReadLease(ch.new_request_id(), (b"F" * 16,)))
        dest = bytearray(lease.sizes[0])
        got = ch.request(so.Pull(ch.new_request_id(), lease.lease_id, b"F" * 16, 0, len(dest)), into=memoryview(dest))
        assert dest == bytes(range(256)) * 8192 and got.payload_sum[0] is PayloadChecksum.XXH3_64
        ch.close()
    finally:
        proc.communicate("", timeout=30)


@pytest.mark.skipif(PayloadChecksum.TSUM64 not in SUPPORTED, reason="native extension not built")
def test_two_native_peers_use_tsum64(peer):
    channel = TcpTransport(TcpConfig(token=TOKEN)).connect(peer)
    assert channel.payload_checksum is PayloadChecksum.TSUM64
    lease = channel.request(so.ReadLease(channel.new_request_id(), (BIG,)))
    dest = bytearray(lease.sizes[0])
    channel.pull_many(lease.lease_id, [(BIG, 0, memoryview(dest))] * 3, window=2)
    assert dest == BLOCKS[BIG]
    channel.close()


def test_views_answers_as_view_does_and_refuses_all_or_nothing():
    """``views`` (one lease check for a PULL_MANY's or PULL_LOCAL's items) gives what ``view``
    gives item by item; a key not under the lease or a range past a block refuses the whole
    call, and an expired lease refuses it too."""
    from tiersync.net.source import BlockError

    now = [0.0]
    blocks = {b"a" * 16: os.urandom(5000), b"b" * 16: os.urandom(300)}
    source = MemoryBlockSource(blocks, clock=lambda: now[0])
    lease = source.lease(so.ReadLease(1, tuple(blocks), ttl_s=30)).lease_id
    items = [(b"a" * 16, 0, 5000), (b"b" * 16, 10, 200), (b"a" * 16, 7, 1)]
    got = source.views(lease, items)
    assert [(bytes(v), k) for v, k in got] == [(bytes(v), k) for v, k in (source.view(lease, *i) for i in items)]
    assert got[0][1] is not None and got[1][1] is None  # a whole block comes with its checksum
    for bad, code in (((b"c" * 16, 0, 1), ev.ErrorCode.NOT_FOUND), ((b"b" * 16, 250, 51), ev.ErrorCode.BAD_REQUEST)):
        with pytest.raises(BlockError) as info:
            source.views(lease, [items[0], bad])
        assert info.value.code is code
    now[0] = 31.0
    with pytest.raises(BlockError) as info:
        source.views(lease, items)
    assert info.value.code is ev.ErrorCode.LEASE_EXPIRED


class _Stalling(MemoryBlockSource):
    """Answers every block but ``SMALL``, whose pulls wait for ``resume`` (a server that stops
    answering with its socket open)."""

    def __init__(self) -> None:
        super().__init__(BLOCKS)
        self.resume = threading.Event()

    def view(self, lease_id, key, offset, length):
        if key == SMALL:
            self.resume.wait(30)
        return super().view(lease_id, key, offset, length)


def test_pipeline_idle_bounds_each_step_not_only_the_batch():
    source = _Stalling()
    server = TcpTransport(TcpConfig(token=TOKEN)).serve("127.0.0.1:0", source)
    channel = TcpTransport(TcpConfig(token=TOKEN)).connect(server.address)
    try:
        lease = channel.request(so.ReadLease(channel.new_request_id(), (BIG, SMALL))).lease_id
        dest = bytearray(1 << 20)
        pulls = [(so.Pull(channel.new_request_id(), lease, BIG, 0, 1 << 20), memoryview(dest))]
        pulls.append((so.Pull(channel.new_request_id(), lease, SMALL, 0, 11), memoryview(bytearray(11))))
        with pytest.raises(NetTimeoutError) as info:
            channel.pipeline(pulls, window=1, timeout=60, idle=0.3)
        assert info.value.context["timeout_s"] == 0.3 and info.value.peer == server.address
        assert dest == BLOCKS[BIG][: 1 << 20] and channel.closed  # answered before the stall: landed
    finally:
        source.resume.set()
        channel.close()
        server.close()


class _SlowLease(MemoryBlockSource):
    """Grants leases a second late (a service's own wait, as prefill->decode's KV_NEXT is)."""

    def lease(self, req):
        threading.Event().wait(1.0)
        return super().lease(req)


def test_pipeline_idle_leaves_answers_that_are_not_data_to_the_deadline():
    server = TcpTransport(TcpConfig(token=TOKEN)).serve("127.0.0.1:0", _SlowLease(BLOCKS))
    channel = TcpTransport(TcpConfig(token=TOKEN)).connect(server.address)
    answers = []
    try:
        ask = so.ReadLease(channel.new_request_id(), (BIG,))
        channel.pipeline([(ask, None)], timeout=60, idle=0.3, landed=lambda rid, a: answers.append(a))
        assert [a.status for a in answers] == [so.LeaseStatus.GRANTED] and not channel.closed
    finally:
        channel.close()
        server.close()


@pytest.mark.parametrize("idle", [0, -1.0, True, "1"])
def test_pipeline_refuses_a_bad_idle_before_sending(peer, idle):
    channel = TcpTransport(TcpConfig(token=TOKEN)).connect(peer)
    try:
        with pytest.raises(UsageError) as info:
            channel.pipeline([(ev.Ping(channel.new_request_id()), None)], idle=idle)
        assert info.value.argument == "idle"
        assert isinstance(channel.request(ev.Ping(channel.new_request_id())), ev.Pong)  # still usable
    finally:
        channel.close()


def test_send_many_writes_requests_in_order_and_refuses_all_or_closes(peer):
    channel = TcpTransport(TcpConfig(token=TOKEN)).connect(peer)
    try:
        pings = [ev.Ping(channel.new_request_id(), token) for token in (1, 2, 3)]
        channel.send_many(pings)
        assert [channel.next_answer(p.request_id).token for p in pings] == [1, 2, 3]
        with pytest.raises(UsageError):  # the first event refused: nothing was sent, the channel stays
            channel.send_many([ev.Pong(channel.new_request_id(), 4), ev.Ping(channel.new_request_id())])
        ping = ev.Ping(channel.new_request_id(), 5)
        channel.send(ping)
        assert channel.next_answer(ping.request_id).token == 5
        with pytest.raises(UsageError):  # refused after one was counted as sent: the channel closes
            channel.send_many([ev.Ping(channel.new_request_id()), ev.Pong(channel.new_request_id(), 6)])
        assert channel.closed
    finally:
        channel.close()
