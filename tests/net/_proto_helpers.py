"""Builders shared by the protocol tests: a handshaken pair and event strategies."""

from __future__ import annotations

from hypothesis import strategies as st

from tiersync.net import events as ev
from tiersync.net import store_ops as so
from tiersync.net.frames import SUPPORTED
from tiersync.net.protocol import NEED_DATA, Connection, Role

KEYS = st.binary(min_size=16, max_size=16)
U64 = st.integers(min_value=0, max_value=2**64 - 1)
RID = st.integers(min_value=1, max_value=2**64 - 1)
TEXT = st.text(max_size=40)


def deliver(src: Connection, dst: Connection, event, chunks=None) -> list:
    """Send ``event`` from src, feed dst in ``chunks`` sized pieces, return dst's events."""
    wire = b"".join(bytes(b) for b in src.send(event))
    return feed(dst, wire, chunks)


def feed(dst: Connection, wire: bytes, chunks=None) -> list:
    out, pos, sizes = [], 0, list(chunks or [])
    while pos < len(wire):
        n = sizes.pop(0) if sizes else len(wire) - pos
        dst.receive_data(wire[pos : pos + max(1, n)])
        pos += max(1, n)
        out.extend(drain(dst))
    return out


def drain(conn: Connection, limit: int = 10_000) -> list:
    out = []
    for _ in range(limit):
        event = conn.next_event()
        if event is NEED_DATA or isinstance(event, ev.ConnectionClosed):
            return out
        out.append(event)
    raise AssertionError("next_event did not stop")  # bounded: never hangs


def ready_pair(checksum=SUPPORTED[0]) -> tuple[Connection, Connection]:
    """A client and server in READY whose payloads are summed by ``checksum`` (default: the best here)."""
    client, server = Connection(Role.CLIENT), Connection(Role.SERVER)
    deliver(client, server, ev.Hello("client", b"c" * 16))
    deliver(server, client, ev.Challenge(b"s" * 16, b"p" * 32, checksum))
    deliver(client, server, ev.Auth(b"q" * 32))
    deliver(server, client, ev.Ready(1))
    return client, server


def requests(rid=RID):
    keys = st.lists(KEYS, max_size=8).map(tuple)
    return st.one_of(
        st.builds(ev.Ping, rid, U64),
        keys.flatmap(
            lambda ks: st.builds(
                so.Offer, rid, U64, st.just(ks), st.lists(U64, min_size=len(ks), max_size=len(ks)).map(tuple)
            )
        ),
        st.builds(so.ReadLease, rid, keys, U64),
        st.builds(so.Pull, rid, U64, KEYS, U64, U64),
        st.builds(so.Release, rid, U64),
    )


def response_for(request):
    """A strategy of valid first answers to ``request``."""
    rid = st.just(request.request_id)
    keys = st.lists(KEYS, max_size=8).map(tuple)
    error = st.builds(ev.Error, rid, st.sampled_from(ev.ErrorCode), TEXT)
    answer = {
        ev.Ping: st.builds(ev.Pong, rid, U64),
        so.Offer: st.builds(so.OfferReply, rid, st.sampled_from(so.OfferStatus), keys),
        so.ReadLease: st.builds(
            so.LeaseReply, rid, st.sampled_from(so.LeaseStatus), U64, U64, st.lists(U64, max_size=8).map(tuple), keys
        ),
        so.Pull: st.builds(ev.Data, rid, st.binary(max_size=3000)),
        so.Release: st.builds(ev.CommitReply, rid, st.sampled_from(ev.CommitStatus), TEXT),
    }[type(request)]
    return st.one_of(answer, error)


CHUNKS = st.lists(st.integers(min_value=1, max_value=200), max_size=30)
