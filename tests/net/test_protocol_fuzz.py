"""Fuzzing the parser with hypothesis.

Invariant (checked by every test here): whatever bytes a peer sends, in whatever
chunking, a :class:`Connection`

1. never raises anything but :class:`ProtocolError` (the peer's fault) from
   ``receive_data`` / ``next_event`` — no struct/index/unicode/memory errors;
2. never hangs: each ``next_event`` call returns, and a bounded drain loop ends
   with NEED_DATA, ConnectionClosed or ProtocolError;
3. once it raised ProtocolError it is poisoned: later calls raise ClosedError;
4. detects corruption: a single flipped bit anywhere in a valid stream, or a
   stream truncated inside a frame followed by EOF, raises ProtocolError — the
   frames before the damage come out intact, corrupted data is never returned;
5. never buffers a payload larger than the configured max frame size.
"""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _proto_helpers import CHUNKS, drain, ready_pair, requests, response_for
from tiersync.errors import ClosedError
from tiersync.net import events as ev
from tiersync.net.errors import ProtocolError, ProtocolFault
from tiersync.net.frames import HEADER_SIZE, MAGIC, PROTOCOL_VERSION, Op, ProtocolConfig, checksum
from tiersync.net.protocol import Connection, Role

FUZZ = settings(max_examples=60, deadline=None)
SMALL = ProtocolConfig(max_frame_size=8192, max_meta_size=2048, max_keys=64)


def _run(conn: Connection, wire: bytes, chunks: list[int]) -> tuple[list, ProtocolError | None]:
    """Feed ``wire`` then EOF; return events seen and the ProtocolError raised, if any."""
    out, pos, sizes = [], 0, list(chunks)
    try:
        while pos < len(wire):
            n = max(1, sizes.pop(0) if sizes else 64)
            conn.receive_data(wire[pos : pos + n])
            pos += n
            out.extend(drain(conn))
        conn.receive_data(b"")
        out.extend(drain(conn))
        assert isinstance(conn.next_event(), ev.ConnectionClosed)
    except ProtocolError as exc:
        with pytest.raises(ClosedError):
            conn.next_event()
        with pytest.raises(ClosedError):
            conn.receive_data(b"x")
        return out, exc
    return out, None


def _stream(data) -> tuple[Connection, bytes, list]:
    """A client in READY, plus a valid wire stream of answers to its requests."""
    client, server = ready_pair()
    wire, expected = b"", []
    for i in range(data.draw(st.integers(1, 4))):
        request = data.draw(requests(st.just(i + 1)))
        for buf in client.send(request):
            server.receive_data(bytes(buf))
        drain(server)
        answer = data.draw(response_for(request))
        wire += b"".join(bytes(b) for b in server.send(answer))
        expected.append(answer)
    return client, wire, expected


@FUZZ
@given(st.binary(max_size=600), CHUNKS, st.sampled_from(list(Role)))
def test_random_bytes_only_raise_protocol_error(blob, chunks, role):
    conn = Connection(role, SMALL)
    events, error = _run(conn, blob, chunks)
    assert error is not None or events == []  # random bytes never pass as a frame


@FUZZ
@given(st.data())
def test_any_single_bit_flip_is_detected(data):
    client, wire, expected = _stream(data)
    bit = data.draw(st.integers(0, len(wire) * 8 - 1))
    damaged = bytearray(wire)
    damaged[bit // 8] ^= 1 << (bit % 8)
    events, error = _run(client, bytes(damaged), data.draw(CHUNKS))
    assert error is not None
    assert events == expected[: len(events)]  # only frames before the flip come out


@FUZZ
@given(st.data())
def test_truncation_then_eof_is_detected(data):
    client, wire, expected = _stream(data)
    cut = data.draw(st.integers(0, len(wire)))
    events, error = _run(client, wire[:cut], data.draw(CHUNKS))
    assert events == expected[: len(events)]
    if error is None:
        assert cut in _boundaries(expected, wire)
    else:
        assert error.fault is ProtocolFault.TRUNCATED and cut not in _boundaries(expected, wire)


def _boundaries(expected: list, wire: bytes) -> set[int]:
    """Offsets in ``wire`` where a frame ends (read from the valid headers)."""
    out, pos = {0}, 0
    while pos < len(wire):
        meta_len, payload_len = struct.unpack_from("<IQ", wire, pos + 20)
        pos += HEADER_SIZE + meta_len + payload_len
        out.add(pos)
    return out


@FUZZ
@given(st.data())
def test_valid_stream_with_random_garbage_spliced_in(data):
    client, wire, expected = _stream(data)
    at = data.draw(st.integers(0, len(wire)))
    junk = data.draw(st.binary(min_size=1, max_size=80))
    events, error = _run(client, wire[:at] + junk + wire[at:], data.draw(CHUNKS))
    assert error is not None
    assert events == expected[: len(events)]


@FUZZ
@given(st.integers(SMALL.max_frame_size + 1, 2**64 - 1))
def test_declared_payload_beyond_the_bound_is_refused_before_buffering(size):
    head = struct.pack(
        "<4sHHIQIQQQB7s", MAGIC, PROTOCOL_VERSION, int(Op.HELLO), 0, 0, 0, size, 0, checksum(b""), 0, bytes(7)
    )
    conn = Connection(Role.SERVER, SMALL)
    conn.receive_data(head + checksum(head).to_bytes(8, "little"))
    with pytest.raises(ProtocolError) as info:
        conn.next_event()
    assert info.value.fault is ProtocolFault.OVERSIZE
