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
from tiersync.net.errors import ProtocolError, ProtocolFault
from tiersync.net.frames import HEADER_SIZE, MAGIC, Op, ProtocolConfig, checksum, encode_header
from tiersync.net.protocol import NEED_DATA, Connection, Role, State

FAST = settings(max_examples=60, deadline=None)


@FAST
@given(st.text(max_size=50), st.binary(min_size=16, max_size=16), CHUNKS)
def test_handshake_round_trips_in_any_chunking(node, nonce, chunks):
    client, server = Connection(Role.CLIENT), Connection(Role.SERVER)
    hello = ev.Hello(node, nonce)
    assert deliver(client, server, hello, chunks) == [hello]
    assert server.state is State.MUST_CHALLENGE
    for src, dst, event in ((server, client, ev.Challenge(nonce, b"")),
                            (client, server, ev.Auth(b"x" * 32)),
                            (server, client, ev.Ready(5))):
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
    more = isinstance(answer, ev.OfferReply) and answer.status in (ev.OfferStatus.ACCEPT, ev.OfferStatus.PARTIAL_EXIST)
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
    deliver(client, server, ev.Pull(9, 1, b"k" * 16, 0, 1000))
    source = bytearray(range(256)) * 4
    bufs = server.send(ev.Data(9, memoryview(source)[:1000]))
    assert isinstance(bufs[1], memoryview) and bufs[1].obj is source
    dest = bytearray(1000)
    client.expect_payload_into(9, dest)
    wire = b"".join(bytes(b) for b in bufs)
    client.receive_data(wire[:HEADER_SIZE + 10])
    assert client.next_event() is NEED_DATA
    sink = client.payload_sink()
    assert sink is not None and len(sink) == 990
    sink[:] = wire[HEADER_SIZE + 10:]
    client.payload_received(990)
    event = client.next_event()
    assert isinstance(event, ev.Data) and dest == source[:1000]


def test_data_of_wrong_size_for_the_sink_is_the_peers_fault():
    client, server = ready_pair()
    deliver(client, server, ev.Pull(3, 1, b"k" * 16, 0, 10))
    client.expect_payload_into(3, bytearray(10))
    with pytest.raises(ProtocolError) as info:
        deliver(server, client, ev.Data(3, b"x" * 11))
    assert info.value.fault is ProtocolFault.MALFORMED


@pytest.mark.parametrize("make", [
    lambda c, s: c.send(ev.Ping(1)),                      # before the handshake
    lambda c, s: s.send(ev.Ready(1)),                     # server skips CHALLENGE
])
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
    cfg = ProtocolConfig(max_frame_size=1024, max_meta_size=512)
    client, server = Connection(Role.CLIENT, cfg), Connection(Role.SERVER, cfg)
    deliver(client, server, ev.Hello("a", b"n" * 16))
    deliver(server, client, ev.Challenge(b"s" * 16, b""))
    deliver(client, server, ev.Auth(b""))
    deliver(server, client, ev.Ready(1))
    deliver(client, server, ev.Pull(1, 1, b"k" * 16, 0, 2000))
    with pytest.raises(UsageError):
        server.send(ev.Data(1, bytes(2000)))


def test_unsolicited_response_poisons_the_connection():
    client, server = ready_pair()
    wire = encode_header(Op.PONG, 77, struct.pack("<Q", 0), 0, checksum(b""))
    client.receive_data(wire + struct.pack("<Q", 0))
    with pytest.raises(ProtocolError) as info:
        client.next_event()
    assert info.value.fault is ProtocolFault.UNEXPECTED
    with pytest.raises(ClosedError):
        client.next_event()
    with pytest.raises(ClosedError):
        client.send(ev.Ping(1))


def _raw(op: int, meta: bytes = b"", payload_len: int = 0, version: int = 1) -> bytes:
    head = struct.pack("<4sHHIQIQQQ8s", MAGIC, version, op, 0, 1, len(meta), payload_len,
                       checksum(b""), checksum(meta), bytes(8))
    return head + checksum(head).to_bytes(8, "little") + meta


@pytest.mark.parametrize("wire, fault", [
    (b"XXXX" + bytes(60), ProtocolFault.BAD_MAGIC),
    (_raw(int(Op.HELLO), version=2), ProtocolFault.BAD_VERSION),
    (_raw(999), ProtocolFault.UNKNOWN_OP),
    (_raw(int(Op.DATA), payload_len=2**60), ProtocolFault.OVERSIZE),
    (_raw(int(Op.HELLO), b"\xff\xff\xff\xff"), ProtocolFault.MALFORMED),
    (_raw(int(Op.PING)), ProtocolFault.UNEXPECTED),
])
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


def test_fatal_error_closes_both_sides():
    client, server = ready_pair()
    assert deliver(server, client, ev.Error(0, ev.ErrorCode.SHUTTING_DOWN, "bye")) == [
        ev.Error(0, ev.ErrorCode.SHUTTING_DOWN, "bye")]
    assert server.state is State.CLOSED and client.state is State.CLOSED
    assert isinstance(client.next_event(), ev.ConnectionClosed)
    with pytest.raises(ClosedError):
        client.send(ev.Ping(1))


def test_clean_eof_between_frames_is_connection_closed():
    client, server = ready_pair()
    server.receive_data(b"")
    assert isinstance(server.next_event(), ev.ConnectionClosed)
    with pytest.raises(UsageError):
        server.receive_data(b"more")


def test_event_fields_are_validated_at_construction():
    with pytest.raises(UsageError):
        ev.Pull(1, 1, b"short", 0, 1)
    with pytest.raises(UsageError):
        ev.Offer(1, 1, (b"k" * 16,), ())
    with pytest.raises(UsageError):
        ev.Ping(-1)
    with pytest.raises(UsageError):
        ProtocolConfig(max_frame_size=0)
