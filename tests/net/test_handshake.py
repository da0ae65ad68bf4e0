"""The handshake's view of the peer (``tiersync.net.handshake``, ``tiersync.net.local.same_host``):
a peer is on this host only when it reports this host's identity *and* its connection comes
from an address of this host; each side learns the other's frame limit."""

from __future__ import annotations

import pytest

from _proto_helpers import deliver, feed
from tiersync.net import events as ev
from tiersync.net.handshake import ServerHandshake
from tiersync.net.local import host_identity, same_host
from tiersync.net.protocol import Connection, Role


@pytest.mark.parametrize(
    ("reported", "ip", "same"),
    [
        ("mine", "127.0.0.1", True),
        ("mine", "::1", True),
        ("mine", "::ffff:127.0.0.1", True),
        ("mine", "192.0.2.1", False),  # TEST-NET-1: never this host's
        ("mine", "", False),
        ("mine", "0.0.0.0", False),
        ("another host", "127.0.0.1", False),
        ("", "127.0.0.1", False),
    ],
)
def test_same_host_needs_the_identity_and_an_address_of_this_host(reported, ip, same):
    assert same_host(host_identity() if reported == "mine" else reported, ip) is same


@pytest.mark.parametrize(("peer_ip", "same"), [("127.0.0.1", True), ("192.0.2.1", False)])
def test_a_hello_repeating_this_hosts_identity_from_afar_is_not_same_host(peer_ip, same):
    """The identity travels in HELLO and READY, so a remote peer can learn and repeat it; the
    server then would have let it read its memory (and told it its addresses)."""
    client, server = Connection(Role.CLIENT), Connection(Role.SERVER)
    hs = ServerHandshake(server, None, 7, peer_ip)
    (hello,) = deliver(client, server, ev.Hello("far", b"n" * 16, host=host_identity(), pid=1, max_frame=1 << 20))
    feed(client, b"".join(bytes(f) for f in hs.step(hello)))  # CHALLENGE
    (auth,) = deliver(client, server, ev.Auth(b""))
    hs.step(auth)
    assert hs.done and hs.info is not None
    assert (hs.info.same_host, hs.info.max_frame) == (same, 1 << 20)
