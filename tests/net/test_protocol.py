"""Protocol unit and round-trip property tests.

Round-trip invariant: for every event E allowed in the current state, feeding
``send(E)`` to the peer in any chunking yields exactly ``[E]`` (equal fields),
and both sides then agree on which requests are outstanding.
"""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _proto_helpers import CHUNKS, deliver, drain, feed, ready_pair, requests, response_for
from tiersync.errors import ClosedError, UsageError
from tiersync.net import events as ev
from tiersync.net import store_ops as so
from tiersync.net.errors import ProtocolError, ProtocolFault
from tiersync.net.events import MAX_CHECKSUMS
from tiersync.net.frame_reader import handshake_limit
from tiersync.net.frames import (
    HEADER_SIZE,
    MAGIC,
    PROTOCOL_VERSION,
    SUPPORTED,
    Op,
    PayloadChecksum,
    ProtocolConfig,
    checksum,
    encode_header,
    negotiate,
    payload_checksum,
)
from tiersync.net.protocol import NEED_DATA, Connection, Role, State

FAST = settings(max_examples=60, deadline=None)
TEXT_ST = st.text(max_size=30)


@FAST
@given(st.text(max_size=50), st.binary(min_size=16, max_size=16), CHUNKS)
def test_handshake_round_trips_in_any_chunking(node, nonce, chunks):
    client, server = Connection(Role.CLIENT), Connection(Role.SERVER)
    hello = ev.Hello(node, nonce)
    assert deliver(client, server, hello, chunks) == [hello]
    assert server.state is State.MUST_CHALLENGE
    for src, dst, event in (
        (server, client, ev.Challenge(nonce, b"")),
        (client, server, ev.Auth(b"x" * 32)),
        (server, client, ev.Ready(5)),
    ):
        assert deliver(src, dst, event, chunks) == [event]
    assert client.state is State.READY and server.state is State.READY


@FAST
@given(st.data())
def test_request_and_answer_round_trip(data):
    client, server = ready_pair()
    request = data.draw(requests())
    src, dst = data.draw(st.sampled_from([(client, server), (server, client)]))
    assert deliver(src, dst, request, data.draw(CHUNKS)) == [request]
    answer = data.draw(response_for(request))
    assert deliver(dst, src, answer, data.draw(CHUNKS)) == [answer]
    more = isinstance(answer, so.OfferReply) and answer.status in (so.OfferStatus.ACCEPT, so.OfferStatus.PARTIAL_EXIST)
    assert src.outstanding == (1 if more else 0)
    if more:
        final = ev.CommitReply(request.request_id, ev.CommitStatus.COMMITTED)
        assert deliver(dst, src, final) == [final]
        assert src.outstanding == 0


def test_many_frames_in_one_chunk_come_out_in_order():
    client, server = ready_pair()
    pings = [ev.Ping(i, i * 7) for i in range(1, 50)]
    wire = b"".join(bytes(b) for p in pings for b in client.send(p))
    assert feed(server, wire) == pings


def test_data_payload_is_sent_without_copy_and_lands_in_caller_buffer():
    client, server = ready_pair()
    deliver(client, server, so.Pull(9, 1, b"k" * 16, 0, 1000))
    source = bytearray(range(256)) * 4
    bufs = server.send(ev.Data(9, memoryview(source)[:1000]))
    assert isinstance(bufs[1], memoryview) and bufs[1].obj is source
    dest = bytearray(1000)
    client.expect_payload_into(9, dest)
    wire = b"".join(bytes(b) for b in bufs)
    client.receive_data(wire[: HEADER_SIZE + 10])
    assert client.next_event() is NEED_DATA
    sink = client.payload_sink()
    assert sink is not None and len(sink) == 990
    sink[:] = wire[HEADER_SIZE + 10 :]
    client.payload_received(990)
    event = client.next_event()
    assert isinstance(event, ev.Data) and dest == source[:1000]


def test_a_reserved_payload_place_stops_reads_at_frame_boundaries_and_lands_once_registered():
    client, server = ready_pair()
    deliver(client, server, ev.Ping(4, 1))  # its answer says where the next payload goes
    deliver(client, server, so.Pull(5, 1, b"k" * 16, 0, 300))
    client.expect_payload_later(5)
    assert client.scatter_target() is None and client.data_fast_targets([5]) == []
    pong = b"".join(bytes(b) for b in server.send(ev.Pong(4, 1)))
    payload = bytes(range(200)) + bytes(100)
    wire = pong + b"".join(bytes(b) for b in server.send(ev.Data(5, payload)))
    at, events = 0, []
    while not events:  # a socket layer reads what read_hint allows (0: as much as it likes)
        take = client.read_hint()
        assert take > 0  # a place is reserved: never an open-ended read
        client.receive_data(wire[at : at + take])
        at += take
        events = drain(client)
    assert events == [ev.Pong(4, 1)] and at == len(pong)  # not one byte of the DATA read on the way
    dest = bytearray(300)
    client.expect_payload_into(5, dest)
    assert client.data_fast_targets([5]) == [memoryview(dest)]
    (data,) = feed(client, wire[at:])
    assert isinstance(data, ev.Data) and data.request_id == 5 and dest == payload


def test_a_reserved_place_never_registered_lands_in_a_buffer_of_its_own():
    client, server = ready_pair()
    deliver(client, server, so.Pull(6, 1, b"k" * 16, 0, 5))
    client.expect_payload_later(6)
    assert client.scatter_target() is None and client.data_fast_targets([6]) == []
    (event,) = deliver(server, client, ev.Data(6, b"abcde"))
    assert isinstance(event, ev.Data) and bytes(event.payload) == b"abcde"
    with pytest.raises(UsageError) as info:
        client.expect_payload_later(6)  # answered: no longer outstanding
    assert info.value.argument == "request_id"


def test_data_of_wrong_size_for_the_sink_is_the_peers_fault():
    client, server = ready_pair()
    deliver(client, server, so.Pull(3, 1, b"k" * 16, 0, 10))
    client.expect_payload_into(3, bytearray(10))
    with pytest.raises(ProtocolError) as info:
        deliver(server, client, ev.Data(3, b"x" * 11))
    assert info.value.fault is ProtocolFault.MALFORMED


@pytest.mark.parametrize(
    "make",
    [
        lambda c, s: c.send(ev.Ping(1)),  # before the handshake
        lambda c, s: s.send(ev.Ready(1)),  # server skips CHALLENGE
    ],
)
def test_sending_in_the_wrong_state_is_usage_error(make):
    client, server = Connection(Role.CLIENT), Connection(Role.SERVER)
    with pytest.raises(UsageError):
        make(client, server)
    assert client.state is State.IDLE  # still usable
    client.send(ev.Hello("a", b"n" * 16))


def test_answering_an_unknown_request_or_reusing_an_id_is_usage_error():
    client, server = ready_pair()
    with pytest.raises(UsageError):
        server.send(ev.Pong(42))
    client.send(ev.Ping(42))
    with pytest.raises(UsageError):
        client.send(ev.Ping(42))
    with pytest.raises(UsageError):
        client.send(ev.Ping(0))


def test_sending_an_oversize_frame_is_usage_error():
    cfg = ProtocolConfig(max_frame_size=4096, max_meta_size=512)
    client, server = Connection(Role.CLIENT, cfg), Connection(Role.SERVER, cfg)
    deliver(client, server, ev.Hello("a", b"n" * 16))
    deliver(server, client, ev.Challenge(b"s" * 16, b""))
    deliver(client, server, ev.Auth(b""))
    deliver(server, client, ev.Ready(1))
    deliver(client, server, so.Pull(1, 1, b"k" * 16, 0, 5000))
    with pytest.raises(UsageError):
        server.send(ev.Data(1, bytes(5000)))


@pytest.mark.parametrize("side", ["client", "server"])
def test_each_end_sends_nothing_larger_than_the_other_accepts(side):
    """HELLO and READY carry each end's max_frame_size: the smaller bounds what either sends
    (frame_limit), and a refused frame changes nothing (the same request is then answered)."""
    big, small = ProtocolConfig(), ProtocolConfig(max_frame_size=8192, max_meta_size=4096)
    client = Connection(Role.CLIENT, small if side == "client" else big)
    server = Connection(Role.SERVER, small if side == "server" else big)
    deliver(client, server, ev.Hello("a", b"n" * 16, max_frame=client.config.max_frame_size))
    deliver(server, client, ev.Challenge(b"s" * 16, b""))
    deliver(client, server, ev.Auth(b""))
    deliver(server, client, ev.Ready(1, max_frame=server.config.max_frame_size))
    assert client.frame_limit == server.frame_limit == 8192
    deliver(client, server, so.Pull(1, 1, b"k" * 16, 0, 9000))
    with pytest.raises(UsageError, match="max_frame_size"):
        server.send(ev.Data(1, bytes(9000)))
    assert [type(e) for e in deliver(server, client, ev.Error(1, ev.ErrorCode.BAD_REQUEST))] == [ev.Error]


@pytest.mark.parametrize("limit", [1, 16, 4095])
@pytest.mark.parametrize("side", ["client", "server"])
def test_a_peer_stating_a_tiny_max_frame_size_is_refused(side, limit):
    """A hostile peer's max_frame of a few bytes would cut every pull into countless pieces:
    its HELLO (or READY) is a protocol error (0 means not stated and is accepted)."""
    client, server = Connection(Role.CLIENT), Connection(Role.SERVER)
    hello = ev.Hello("a", b"n" * 16, max_frame=limit if side == "client" else 0)
    if side == "client":
        with pytest.raises(ProtocolError, match="max_frame_size"):
            deliver(client, server, hello)
        return
    deliver(client, server, hello)
    deliver(server, client, ev.Challenge(b"s" * 16, b""))
    deliver(client, server, ev.Auth(b""))
    with pytest.raises(ProtocolError, match="max_frame_size"):
        deliver(server, client, ev.Ready(1, max_frame=limit))


def test_unsolicited_response_poisons_the_connection():
    client, _server = ready_pair()
    wire = encode_header(Op.PONG, 77, struct.pack("<Q", 0), 0, checksum(b""))
    client.receive_data(wire + struct.pack("<Q", 0))
    with pytest.raises(ProtocolError) as info:
        client.next_event()
    assert info.value.fault is ProtocolFault.UNEXPECTED
    with pytest.raises(ClosedError):
        client.next_event()
    with pytest.raises(ClosedError):
        client.send(ev.Ping(1))


def _raw(op: int, meta: bytes = b"", payload_len: int = 0, version: int = PROTOCOL_VERSION, algo: int = 0) -> bytes:
    head = struct.pack(
        "<4sHHIQIQQQB7s",
        MAGIC,
        version,
        op,
        0,
        1,
        len(meta),
        payload_len,
        checksum(b""),
        checksum(meta),
        algo,
        bytes(7),
    )
    return head + checksum(head).to_bytes(8, "little") + meta


@pytest.mark.parametrize(
    "wire, fault",
    [
        (b"XXXX" + bytes(60), ProtocolFault.BAD_MAGIC),
        (_raw(int(Op.HELLO), version=PROTOCOL_VERSION + 1), ProtocolFault.BAD_VERSION),
        (_raw(int(Op.HELLO), version=1), ProtocolFault.BAD_VERSION),  # pre-negotiation builds are refused
        (_raw(int(Op.HELLO), algo=200), ProtocolFault.BAD_CHECKSUM),  # an algorithm this build lacks
        (_raw(999), ProtocolFault.UNKNOWN_OP),
        (_raw(int(Op.DATA), payload_len=2**60), ProtocolFault.OVERSIZE),
        (_raw(int(Op.HELLO), b"\xff\xff\xff\xff"), ProtocolFault.MALFORMED),
        (_raw(int(Op.PING)), ProtocolFault.UNEXPECTED),
    ],
)
def test_bad_frames_raise_the_documented_fault(wire, fault):
    server = Connection(Role.SERVER)
    server.receive_data(wire)
    with pytest.raises(ProtocolError) as info:
        server.next_event()
    assert info.value.fault is fault


def test_oversize_is_refused_from_the_header_alone():
    server = Connection(Role.SERVER, ProtocolConfig(max_frame_size=4096, max_meta_size=1024))
    server.receive_data(_raw(int(Op.HELLO), b"", payload_len=5000)[:HEADER_SIZE])
    with pytest.raises(ProtocolError) as info:
        server.next_event()
    assert info.value.fault is ProtocolFault.OVERSIZE


def test_before_ready_a_frame_is_bounded_by_the_largest_handshake_message():
    server = Connection(Role.SERVER)
    limit = handshake_limit(server.config)
    server.receive_data(_raw(int(Op.HELLO), bytes(limit + 1))[:HEADER_SIZE])  # the header alone
    with pytest.raises(ProtocolError) as info:
        server.next_event()
    assert info.value.fault is ProtocolFault.OVERSIZE and info.value.context["limit"] == limit
    # the largest HELLO there is (both strings at max_string bytes, every checksum id) still passes
    longest = "n" * server.config.max_string
    hello = ev.Hello(longest, b"c" * 16, tuple(range(MAX_CHECKSUMS)), host=longest, pid=2**63)
    fresh = Connection(Role.SERVER)
    fresh.receive_data(_raw(int(Op.HELLO), hello.meta()))
    assert len(hello.meta()) <= limit and fresh.next_event() == hello
    # once READY the connection's own bounds apply: a request larger than any handshake frame
    client, server = ready_pair()
    items = tuple((bytes([i]) * 16, 0, 1) for i in range(limit // 32 + 1))
    request = so.PullMany(7, 1, items)
    assert len(request.meta()) > limit and deliver(client, server, request) == [request]


def test_fatal_error_closes_both_sides():
    client, server = ready_pair()
    assert deliver(server, client, ev.Error(0, ev.ErrorCode.SHUTTING_DOWN, "bye")) == [
        ev.Error(0, ev.ErrorCode.SHUTTING_DOWN, "bye")
    ]
    assert server.state is State.CLOSED and client.state is State.CLOSED
    assert isinstance(client.next_event(), ev.ConnectionClosed)
    with pytest.raises(ClosedError):
        client.send(ev.Ping(1))


def test_clean_eof_between_frames_is_connection_closed():
    _client, server = ready_pair()
    server.receive_data(b"")
    assert isinstance(server.next_event(), ev.ConnectionClosed)
    with pytest.raises(UsageError):
        server.receive_data(b"more")


def test_event_fields_are_validated_at_construction():
    with pytest.raises(UsageError):
        so.Pull(1, 1, b"short", 0, 1)
    with pytest.raises(UsageError):
        so.Offer(1, 1, (b"k" * 16,), ())
    with pytest.raises(UsageError):
        ev.Ping(-1)
    with pytest.raises(UsageError):
        ProtocolConfig(max_frame_size=0)
    with pytest.raises(UsageError, match="at least 4096"):
        ProtocolConfig(max_frame_size=4095, max_meta_size=1024)


def test_local_reply_regions_travel_as_one_array_and_are_checked():
    """LOCAL_REPLY's regions are an (n, 3) uint64 array end to end: tuples of ints are
    accepted, anything else is refused naming ``regions``, and a parsed reply equals the sent one."""
    import numpy as np

    client, server = ready_pair(SUPPORTED[0])
    deliver(client, server, so.PullLocal(6, 1, ((b"k" * 16, 0, 10), (b"j" * 16, 4, 20))))
    sent = ev.LocalReply(6, 1234, SUPPORTED[0], ((1 << 40, 10, 2**64 - 1), (8, 20, 0)))
    [got] = feed(client, b"".join(bytes(b) for b in server.send(sent)), [7, 1, 100])
    assert (
        got == sent
        and got.regions.dtype == np.uint64
        and got.regions.tolist() == [[1 << 40, 10, 2**64 - 1], [8, 20, 0]]
    )
    assert got != ev.LocalReply(6, 1234, SUPPORTED[0], ((1 << 40, 10, 2**64 - 2), (8, 20, 0)))
    with pytest.raises(ValueError, match="read-only"):
        got.regions[0, 0] = 1  # read-only: what was verified stays what is copied
    for bad in (((1, 2),), ((1, 2, -1),), np.zeros((2, 3), np.int64), np.zeros(3, np.uint64), "abc"):
        with pytest.raises(UsageError) as exc:
            ev.LocalReply(6, 1, SUPPORTED[0], bad)
        assert exc.value.argument == "regions"


def test_local_reply_mapping_travels_and_a_bad_one_is_refused():
    """LOCAL_REPLY's optional mapping (fd, address, nbytes, offset) survives the wire; a malformed one
    is refused naming ``mapping`` when built and MALFORMED when parsed (a flag other than 0 or
    1, or a truncated mapping)."""
    from tiersync.net.codec import MetaReader

    client, server = ready_pair(SUPPORTED[0])
    deliver(client, server, so.PullLocal(6, 1, ((b"k" * 16, 0, 10),)))
    sent = ev.LocalReply(6, 1234, SUPPORTED[0], ((1 << 40, 10, 5),), (7, 1 << 40, 1 << 30, 1 << 20))
    [got] = feed(client, b"".join(bytes(b) for b in server.send(sent)), [5, 90])
    assert got == sent and got.mapping == (7, 1 << 40, 1 << 30, 1 << 20)
    assert got != ev.LocalReply(6, 1234, SUPPORTED[0], ((1 << 40, 10, 5),))
    for bad in ((1, 2, 3), (1, 2, 3, -1), [1, 2, 3, 4], (1, 2, 3, "4")):
        with pytest.raises(UsageError) as exc:
            ev.LocalReply(6, 1, SUPPORTED[0], (), bad)
        assert exc.value.argument == "mapping"
    meta = ev.LocalReply(6, 1, SUPPORTED[0], ((8, 1, 1),), (1, 2, 3, 4)).meta()
    flag_at = 8 + 1 + 4 + 24
    for broken in (meta[:flag_at] + b"\x02" + meta[flag_at + 1 :], meta[:-1]):
        with pytest.raises(ProtocolError) as err:
            ev.LocalReply.parse(6, MetaReader(broken), ProtocolConfig())
        assert err.value.fault is ProtocolFault.MALFORMED


# -- payload checksum negotiation ------------------------------------------------------------
@pytest.mark.parametrize("algo", SUPPORTED)
def test_data_carries_the_negotiated_algorithm_and_round_trips(algo):
    client, server = ready_pair(algo)
    assert client.payload_algo is algo and server.payload_algo is algo
    deliver(client, server, so.Pull(4, 1, b"k" * 16, 0, 5000))
    payload = bytes(range(250)) * 20
    wire = b"".join(bytes(b) for b in server.send(ev.Data(4, payload)))
    assert wire[48] == int(algo)
    [got] = feed(client, wire, [100, 3, 4000])
    assert got == ev.Data(4, payload) and got.payload_sum[0] is algo


def test_hello_offers_this_builds_checksums_and_the_server_picks_one_offered():
    client, server = Connection(Role.CLIENT), Connection(Role.SERVER)
    hello = ev.Hello("c", b"n" * 16)
    assert hello.checksums == tuple(int(a) for a in SUPPORTED)
    with pytest.raises(UsageError):
        client.send(ev.Hello("c", b"n" * 16, (200,)))  # an id this build cannot verify
    assert client.state is State.IDLE
    deliver(client, server, ev.Hello("c", b"n" * 16, (int(PayloadChecksum.XXH3_64),)))
    assert server.peer_checksums == (0,)
    if PayloadChecksum.TSUM64 in SUPPORTED:
        with pytest.raises(UsageError):  # the client did not offer it
            server.send(ev.Challenge(b"s" * 16, b"", PayloadChecksum.TSUM64))
    deliver(server, client, ev.Challenge(b"s" * 16, b"", PayloadChecksum.XXH3_64))
    assert client.payload_algo is server.payload_algo is PayloadChecksum.XXH3_64


def test_unknown_offered_ids_are_ignored_by_negotiate():
    assert negotiate((77, 0)) is PayloadChecksum.XXH3_64
    assert negotiate(tuple(int(a) for a in SUPPORTED)) is SUPPORTED[0]
    with pytest.raises(ProtocolError) as info:
        negotiate((77,))
    assert info.value.fault is ProtocolFault.MALFORMED


@pytest.mark.skipif(PayloadChecksum.TSUM64 not in SUPPORTED, reason="native extension not built")
def test_a_pick_the_client_did_not_offer_is_the_servers_fault():
    client, server = Connection(Role.CLIENT), Connection(Role.SERVER)
    client.send(ev.Hello("c", b"n" * 16, (0,)))
    deliver(Connection(Role.CLIENT), server, ev.Hello("other", b"n" * 16))  # offers TSUM64 too
    with pytest.raises(ProtocolError) as info:
        deliver(server, client, ev.Challenge(b"s" * 16, b"", PayloadChecksum.TSUM64))
    assert info.value.fault is ProtocolFault.MALFORMED


def test_a_known_payload_sum_is_sent_and_a_stale_one_is_refused():
    algo = SUPPORTED[0]
    client, server = ready_pair(algo)
    payload = b"z" * 3000
    deliver(client, server, so.Pull(1, 1, b"k" * 16, 0, 3000))
    [got] = deliver(server, client, ev.Data(1, payload, (algo, payload_checksum(algo, payload))))
    assert bytes(got.payload) == payload
    deliver(client, server, so.Pull(2, 1, b"k" * 16, 0, 3000))
    with pytest.raises(ProtocolError) as info:
        deliver(server, client, ev.Data(2, payload, (algo, 12345)))
    assert info.value.fault is ProtocolFault.BAD_CHECKSUM


# -- scatter reads: header plus the predicted payload buffer in one read -------------------------
def _socket_like_feed(conn: Connection, wire: bytes, chunks: list[int]) -> list:
    """Feed ``wire`` the way FramedSocket does: payload sink, else scatter read, else buffer."""
    out, pos, sizes, head = [], 0, list(chunks), bytearray(HEADER_SIZE)
    while pos < len(wire):
        n = max(1, sizes.pop(0) if sizes else 1 << 30)
        sink, target = conn.payload_sink(), conn.scatter_target()
        if sink is not None:
            n = min(n, len(sink), len(wire) - pos)
            sink[:n] = wire[pos : pos + n]
            conn.payload_received(n)
        elif target is not None:
            n = min(n, HEADER_SIZE + len(target), len(wire) - pos)
            got = wire[pos : pos + n]
            head[: min(n, HEADER_SIZE)] = got[:HEADER_SIZE]
            target[: max(0, n - HEADER_SIZE)] = got[HEADER_SIZE:]
            conn.scatter_received(head, n)
        else:
            n = min(n, len(wire) - pos)
            conn.receive_data(wire[pos : pos + n])
        pos += n
        out.extend(drain(conn))
    return out


@FAST
@given(st.data())
def test_scatter_reads_deliver_the_same_events_and_bytes(data):
    client, server = ready_pair()
    sizes = data.draw(st.lists(st.integers(0, 3000), min_size=1, max_size=6))
    dests, wire, expected = [], b"", []
    for rid, size in enumerate(sizes, start=1):
        for buf in client.send(so.Pull(rid, 1, b"k" * 16, 0, size)):
            server.receive_data(bytes(buf))
        drain(server)
        dests.append(bytearray(size))
        client.expect_payload_into(rid, dests[-1])
        if data.draw(st.booleans()):
            answer = ev.Data(rid, data.draw(st.binary(min_size=size, max_size=size)))
        else:  # not the predicted DATA: the bytes read into the buffer go back into the stream
            answer = ev.Error(rid, ev.ErrorCode.NOT_FOUND, data.draw(TEXT_ST))
        wire += b"".join(bytes(b) for b in server.send(answer))
        expected.append(answer)
    got = _socket_like_feed(client, wire, data.draw(CHUNKS))
    assert got == expected and client.outstanding == 0
    for answer, dest in zip(expected, dests):
        if isinstance(answer, ev.Data):
            assert dest == answer.payload


def test_scatter_received_without_a_target_is_usage_error():
    client, _server = ready_pair()
    assert client.scatter_target() is None
    with pytest.raises(UsageError):
        client.scatter_received(bytearray(HEADER_SIZE), 10)


@pytest.mark.parametrize("key_len", [0, 15, 17])
def test_a_pull_whose_key_is_not_16_bytes_is_the_peers_fault(key_len):
    """The fixed-layout PULL parse takes only the exact layout; any other key length is refused."""
    _client, server = ready_pair()
    meta = struct.pack("<QI", 1, key_len) + b"k" * key_len + struct.pack("<QQ", 0, 8)
    with pytest.raises(ProtocolError) as exc:
        feed(server, encode_header(Op.PULL, 9, meta, 0, checksum(b"")) + meta)
    assert exc.value.fault is ProtocolFault.MALFORMED


def test_a_pull_with_trailing_metadata_is_the_peers_fault():
    _client, server = ready_pair()
    meta = struct.pack("<QI", 1, 16) + b"k" * 16 + struct.pack("<QQ", 0, 8) + b"!"
    with pytest.raises(ProtocolError) as exc:
        feed(server, encode_header(Op.PULL, 9, meta, 0, checksum(b"")) + meta)
    assert exc.value.fault is ProtocolFault.MALFORMED


@FAST
@given(
    st.integers(0, 2**64 - 1), st.binary(min_size=16, max_size=16), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)
)
def test_a_parsed_pull_equals_the_one_sent(lease, key, offset, length):
    client, server = ready_pair()
    pull = so.Pull(client.outstanding + 1, lease, key, offset, length)
    assert deliver(client, server, pull) == [pull]


def test_every_core_and_store_op_has_exactly_one_event_class():
    """The Op enum (core 1-15 and DATA, block store 16-31) and the two vocabularies agree:
    each op code parses to one class whose OP is that member."""
    from tiersync.net.frames import Op

    assert set(so.STORE.types) == {int(op) for op in Op}
    assert all(cls.OP is Op(code) for code, cls in so.STORE.types.items())
    assert set(ev.CORE.types) < set(so.STORE.types)
