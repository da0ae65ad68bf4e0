"""Where a store node pulls an OFFER's blocks from: only the IP the writer connects from
(tiersync.net.offer_source.writer_address), whatever host the OFFER names."""

from __future__ import annotations

import socket

import pytest

from _peer import TOKEN
from tiersync.net import events as ev
from tiersync.net import store_ops as so
from tiersync.net.errors import RequestError
from tiersync.net.offer_source import writer_address
from tiersync.net.source import BlockError
from tiersync.net.store_client import _named_host
from tiersync.net.store_node import StoreNode, StoreNodeClient, StoreNodeServer
from tiersync.net.tcp import TcpConfig, TcpTransport

BLOCK = 256 << 10


def test_the_writer_address_is_the_ip_it_connects_from():
    assert writer_address("10.0.0.7:4000", "10.0.0.7:9") == "10.0.0.7:4000"  # the IP we saw, named
    assert writer_address(":4000", "10.0.0.7:51234") == "10.0.0.7:4000"  # empty host: the IP we saw
    assert writer_address(":4000", "[::1]:51234") == "[::1]:4000"
    assert writer_address("10.0.0.7:4000", "[::ffff:10.0.0.7]:9") == "10.0.0.7:4000"  # v4-mapped peer
    assert writer_address("[fe80::1%eth0]:4000", "[fe80::1%ens5]:9") == "[fe80::1%ens5]:4000"  # its scope
    for source, peer in [
        ("10.1.2.3:4000", "127.0.0.1:9"),  # another host
        ("example.com:4000", "10.0.0.7:9"),  # names are not resolved
        ("[::2]:4000", "[::1]:9"),
        (":4000", None),  # no peer address
        ("", "10.0.0.7:1"),
        (":0", "10.0.0.7:1"),
        (":x", "10.0.0.7:1"),
        (":\u00b2", "10.0.0.7:1"),  # a digit to str.isdigit, not to int()
        (":70000", "10.0.0.7:1"),
    ]:
        with pytest.raises(BlockError) as info:
            writer_address(source, peer)
        assert info.value.code is ev.ErrorCode.BAD_REQUEST, (source, peer)


def test_a_writer_names_a_specific_ip_and_leaves_the_rest_to_the_kernel():
    assert _named_host("127.0.0.1") == "127.0.0.1" and _named_host("[::1]") == "::1"
    for wildcard_or_name in ("", "0.0.0.0", "::", "[::]", "0:0:0:0:0:0:0:0", "localhost", "node-a.example"):
        assert _named_host(wildcard_or_name) == "", wildcard_or_name


@pytest.fixture
def served():
    node = StoreNode(1 << 20, BLOCK, config=TcpConfig(token=TOKEN.encode()))
    server = StoreNodeServer("127.0.0.1:0", node)
    yield node, server
    server.close()
    node.close()


def test_an_offer_naming_another_host_is_answered_why_and_never_dialled(served):
    """An authenticated writer cannot make the node connect anywhere but back to it: an OFFER
    from 127.0.0.1 naming a listener on 127.0.0.2 (or naming none) is answered ERROR saying
    why, that listener sees nothing, and the session goes on."""
    node, server = served
    bait = socket.create_server(("127.0.0.2", 0))
    ch = TcpTransport(TcpConfig(token=TOKEN.encode())).connect(server.address)
    try:
        for source in (f"127.0.0.2:{bait.getsockname()[1]}", ""):
            with pytest.raises(RequestError) as info:
                ch.request(so.Offer(ch.new_request_id(), 1, (b"k" * 16,), (16,), source))
            assert info.value.code is ev.ErrorCode.BAD_REQUEST and node.free_blocks == 4
        assert "127.0.0.1" in str(info.value) or "not 'host:port'" in str(info.value)
        assert isinstance(ch.request(ev.Ping(ch.new_request_id())), ev.Pong)
        bait.settimeout(0.5)  # a dial would have come before the answer
        with pytest.raises(TimeoutError):
            bait.accept()
    finally:
        ch.close()
        bait.close()


@pytest.mark.parametrize("bind", ["0.0.0.0", "127.0.0.1", "localhost"])
def test_a_writer_bound_anywhere_on_this_host_is_dialled_back(served, bind):
    node, server = served
    keys, bufs = [bytes([7, i]) * 8 for i in range(2)], [bytes([i]) * 1000 for i in range(2)]
    res = StoreNodeClient(server.address, token=TOKEN.encode(), timeout=10, bind_host=bind).offer_and_push(keys, bufs)
    assert res.commit is ev.CommitStatus.COMMITTED and node.stored == 2


def _primary_ip() -> str | None:
    """This host's address on its default route (no packet is sent), None without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
        except OSError:
            return None
        ip = s.getsockname()[0]
    return None if ip.startswith("127.") else ip


def test_a_loopback_writer_pushes_to_a_node_on_another_address_of_this_host():
    """The default bind_host (127.0.0.1) and a node listening on this host's LAN address: the
    writer connects from 127.0.0.1 too, so the node dials back where the writer serves."""
    ip = _primary_ip()
    if ip is None:
        pytest.skip("no non-loopback address on this host")
    node = StoreNode(1 << 20, BLOCK, config=TcpConfig(token=TOKEN.encode()))
    server = StoreNodeServer(f"{ip}:0", node)
    try:
        keys, bufs = [bytes([8, i]) * 8 for i in range(2)], [bytes([i]) * 999 for i in range(2)]
        res = StoreNodeClient(server.address, token=TOKEN.encode(), timeout=10).offer_and_push(keys, bufs)
        assert res.commit is ev.CommitStatus.COMMITTED and node.stored == 2
    finally:
        server.close()
        node.close()


def test_closing_the_pulls_ends_one_still_dialing_a_writer_that_never_answers_within_connect_timeout_s():
    """A writer whose kernel accepts the node's dial but whose process never speaks (stopped):
    the pull gives the dial at most ``connect_timeout_s``, not its whole ``pull_timeout_s``, so
    a node that closes meanwhile does not wait a minute for it; a pull taken after the close
    does not dial at all."""
    import threading
    import time

    from tiersync.errors import ClosedError, TierSyncError
    from tiersync.net.offer_source import WriterPulls

    pulls = WriterPulls(TcpConfig(token=TOKEN.encode(), connect_timeout_s=1.0))
    with socket.create_server(("127.0.0.1", 0)) as silent:  # the kernel accepts; nobody answers
        writer = f"127.0.0.1:{silent.getsockname()[1]}"
        failed: list[BaseException] = []

        def pull() -> None:
            try:
                pulls.pull(writer, 1, [(b"k" * 16, 0, memoryview(bytearray(8)))], 60.0)
            except TierSyncError as exc:
                failed.append(exc)

        began = time.monotonic()
        t = threading.Thread(target=pull)
        t.start()
        silent.settimeout(10)
        dialed, _ = silent.accept()  # the dial is under way: connected, its handshake unanswered
        pulls.close()
        t.join(30)
        dialed.close()
        assert not t.is_alive() and len(failed) == 1 and time.monotonic() - began < 20
        with pytest.raises(ClosedError):
            pulls.pull(writer, 2, [(b"k" * 16, 0, memoryview(bytearray(8)))], 60.0)
