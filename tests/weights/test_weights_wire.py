"""The weight-sync wire format over real socket pairs: round trips, bounds, checksums, deadlines."""
from __future__ import annotations

import socket
import struct

import numpy as np
import pytest

from tiersync.net.errors import NetTimeoutError, PeerClosedError, ProtocolError, ProtocolFault
from tiersync.weights.segment import HEADER_BYTES, SegmentReader, SegmentWriter, tensor_offsets
from tiersync.weights.server import parse_span, span_payload
from tiersync.weights.spans import StridedSpan
from tiersync.weights.wire import HEADER_SIZE, Deadline, Op, recv_message, recv_payload, send_message


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def _raw(op: Op, meta: dict, payload: bytes = b"", checksum: bool = True) -> bytes:
    a, b = socket.socketpair()
    send_message(a, op, meta, Deadline(5, "t"), [memoryview(payload)] if payload else [], checksum=checksum)
    a.close()
    out = b""
    while chunk := b.recv(1 << 16):
        out += chunk
    b.close()
    return out


def test_round_trip_with_scatter_gather_payload(pair):
    a, b = pair
    parts = [memoryview(np.arange(1000, dtype=np.uint8)), memoryview(b"xyz" * 50)]
    send_message(a, Op.DATA, {"k": [1, 2]}, Deadline(5, "a"), parts, checksum=True)
    msg = recv_message(b, Deadline(5, "b"), 1 << 10)
    assert msg.op is Op.DATA and msg.meta == {"k": [1, 2]} and msg.checksummed
    into = bytearray(msg.payload_len)
    recv_payload(b, msg, memoryview(into), Deadline(5, "b"), verify=True)
    assert bytes(into) == bytes(parts[0]) + bytes(parts[1])


@pytest.mark.parametrize("offset, fault", [(0, ProtocolFault.BAD_MAGIC), (4, ProtocolFault.BAD_VERSION),
                                           (9, ProtocolFault.BAD_CHECKSUM), (HEADER_SIZE + 2, ProtocolFault.BAD_CHECKSUM)])
def test_corrupted_bytes_are_rejected_before_use(pair, offset, fault):
    raw = bytearray(_raw(Op.GET, {"v": 1}))
    raw[offset] ^= 0xFF
    a, b = pair
    a.sendall(raw)
    with pytest.raises(ProtocolError) as exc:
        recv_message(b, Deadline(5, "b"), 1 << 10)
    assert exc.value.fault is fault


def test_oversize_metadata_is_refused_from_the_header(pair):
    a, b = pair
    a.sendall(_raw(Op.HELLO, {"x": "y" * 5000})[:HEADER_SIZE])  # only the header: never read further
    with pytest.raises(ProtocolError) as exc:
        recv_message(b, Deadline(5, "b"), 1 << 10)
    assert exc.value.fault is ProtocolFault.OVERSIZE


def test_payload_length_and_checksum_are_checked(pair):
    a, b = pair
    raw = bytearray(_raw(Op.DATA, {}, b"0123456789"))
    a.sendall(raw)
    msg = recv_message(b, Deadline(5, "b"), 1 << 10)
    with pytest.raises(ProtocolError) as exc:
        recv_payload(b, msg, memoryview(bytearray(5)), Deadline(5, "b"), verify=True)
    assert exc.value.fault is ProtocolFault.OVERSIZE
    raw[-1] ^= 1  # flip a payload bit
    a.sendall(raw)
    b.recv(10)  # drain the unread payload of the first message
    msg = recv_message(b, Deadline(5, "b"), 1 << 10)
    with pytest.raises(ProtocolError) as exc:
        recv_payload(b, msg, memoryview(bytearray(10)), Deadline(5, "b"), verify=True)
    assert exc.value.fault is ProtocolFault.BAD_CHECKSUM


def test_eof_and_deadline(pair):
    a, b = pair
    with pytest.raises(NetTimeoutError):
        recv_message(b, Deadline(0.2, "b"), 1 << 10)
    a.sendall(_raw(Op.ACK, {"v": 1})[:20])
    a.close()
    with pytest.raises(PeerClosedError):
        recv_message(b, Deadline(5, "b"), 1 << 10)


def test_span_parsing_and_payload_bounds():
    shard = np.arange(64, dtype=np.uint8)
    span = parse_span({"o": 2, "r": 3, "c": [4], "s": [10]})
    got = b"".join(bytes(v) for v in span_payload(shard, span))
    assert got == bytes([2, 3, 4, 12, 13, 14, 22, 23, 24, 32, 33, 34])
    with pytest.raises(ProtocolError):
        span_payload(shard, StridedSpan(60, 8))
    for bad in ({"o": -1, "r": 1, "c": [], "s": []}, {"o": 0, "r": 0, "c": [], "s": []}, {"o": 0},
                {"o": 0, "r": 1, "c": [2], "s": []}):
        with pytest.raises(ProtocolError):
            parse_span(bad)


def test_segment_header_size_and_version_checks(tmp_path):
    offsets, payload = tensor_offsets([10, 5000])
    assert offsets == [HEADER_BYTES, HEADER_BYTES + 4096] and payload == 4096 * 3
    path = str(tmp_path / "seg")
    w = SegmentWriter(path, payload)
    try:
        w.begin(7)
        w.region(offsets[1], 5000)[:] = 9
        w.complete(7)
        r = SegmentReader(path, payload)
        assert r.header() == (7, 2) and r.still_version(7)
        assert int(r.region(offsets[1], 5000).min()) == 9 and not r.region(offsets[1], 1).flags.writeable
        w.begin(8)
        assert not r.still_version(7)  # a reader of 7 learns the writer moved on
        r.close()
        from tiersync.errors import IntegrityError

        with pytest.raises(IntegrityError):
            SegmentReader(path, payload + 4096)  # the manifest's size must match the file's
        with open(path, "r+b") as f:
            f.write(struct.pack("<8s", b"NOTASEG!"))
        with pytest.raises(IntegrityError):
            SegmentReader(path, payload)
    finally:
        w.close()
