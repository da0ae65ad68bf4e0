"""The handshake's view of the peer (``tiersync.net.handshake``, ``tiersync.net.local.same_host``):
a peer is on this host only when it reports this host's identity *and* its connection comes
from an address of this host; each side learns the other's frame limit."""

from __future__ import annotations

import socket

import pytest

from _proto_helpers import deliver, feed
from tiersync.net import events as ev
from tiersync.net.handshake import ServerHandshake
from tiersync.net.local import host_identity, local_address, same_host
from tiersync.net.protocol import Connection, Role


@pytest.mark.parametrize(
    ("reported", "ip", "same"),
    [
        ("mine", "127.0.0.1", True),
        ("mine", "::1", True),
        ("mine", "::ffff:127.0.0.1", True),
        ("mine", "198.51.100.7", False),  # TEST-NET-2: never this host's
        ("mine", "fe80::1", False),  # link-local: its scope is not in the string, so not trusted
        ("mine", "", False),
        ("mine", "0.0.0.0", False),
        ("another host", "127.0.0.1", False),
        ("", "127.0.0.1", False),
    ],
)
def test_same_host_needs_the_identity_and_an_address_of_this_host(reported, ip, same):
    assert same_host(host_identity() if reported == "mine" else reported, ip) is same


@pytest.mark.parametrize(("peer_ip", "same"), [("127.0.0.1", True), ("198.51.100.7", False)])
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


def test_this_hosts_own_address_is_local_by_its_route_not_by_bind():
    """The address this host sends from is local (the kernel routes it to itself); a bind test
    would pass for any address on a host with ip_nonlocal_bind, a route test does not."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("198.51.100.7", 9))
        except OSError:
            pytest.skip("no IPv4 route here")
        own = s.getsockname()[0]
    assert local_address(own) and local_address("127.0.0.5") and not local_address("198.51.100.7")
