"""Sans-IO KV frames: round trips, every corruption refused, fuzzed input never crashes."""
from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings, strategies as st

from tiersync.disagg.wire import HEADER_SIZE, NEED_DATA, Decoder, Frame, Kind, WireLimits, encode
from tiersync.errors import UsageError
from tiersync.net.errors import ProtocolError, ProtocolFault


def _bytes(kind, meta=None, payload=()):
    return b"".join(bytes(v) for v in encode(kind, meta, payload))


def _feed(dec, data, step=7):
    """Feed ``data`` in ``step``-byte pieces; return complete frames (payloads into fresh buffers)."""
    frames, pos = [], 0
    while True:
        ev = dec.next_event()
        if ev is NEED_DATA:
            if pos >= len(data):
                dec.received(0)
                continue
            view = dec.recv_view()
            n = min(step, len(view), len(data) - pos)
            view[:n] = data[pos:pos + n]
            pos += n
            dec.received(n)
        elif ev is None:
            return frames
        elif ev.payload is not None:
            frames.append(ev)


def test_roundtrip_several_frames_in_pieces():
    data = _bytes(Kind.READ, {"a": [1, 2]}) + _bytes(Kind.LAYER, {"layer": 3}, [b"xy", bytearray(b"z" * 100)])
    frames = _feed(Decoder(), data)
    assert [f.kind for f in frames] == [Kind.READ, Kind.LAYER]
    assert frames[0].meta == {"a": [1, 2]} and bytes(frames[1].payload) == b"xy" + b"z" * 100


def test_payload_lands_in_sink():
    dec, sink = Decoder(), bytearray(5)
    data = _bytes(Kind.LAYER, {}, [b"hello"])
    for lo, hi in ((0, HEADER_SIZE), (HEADER_SIZE, HEADER_SIZE + 2)):  # header, then the "{}" metadata
        assert dec.next_event() is NEED_DATA
        dec.recv_view()[:hi - lo] = data[lo:hi]
        dec.received(hi - lo)
    head = dec.next_event()
    assert isinstance(head, Frame) and head.payload is None and head.payload_len == 5
    dec.set_sink(memoryview(sink))
    view = dec.recv_view()
    view[:5] = data[HEADER_SIZE + 2:]
    dec.received(5)
    assert bytes(dec.next_event().payload) == b"hello" and sink == b"hello"
    with pytest.raises(UsageError):
        dec.set_sink(bytearray(5))


@pytest.mark.parametrize("offset,fault", [
    (0, ProtocolFault.BAD_MAGIC), (4, ProtocolFault.BAD_VERSION), (6, ProtocolFault.BAD_CHECKSUM),
    (20, ProtocolFault.BAD_CHECKSUM), (HEADER_SIZE + 1, ProtocolFault.BAD_CHECKSUM),
    (-1, ProtocolFault.BAD_CHECKSUM),
])
def test_corruption_refused(offset, fault):
    data = bytearray(_bytes(Kind.LAYER, {"k": 1}, [b"payload"]))
    data[offset] ^= 0x40
    dec = Decoder()
    with pytest.raises(ProtocolError) as e:
        _feed(dec, bytes(data))
    assert e.value.fault is fault
    with pytest.raises(ProtocolError):  # poisoned
        dec.next_event()


def _forged(kind=1, flags=0, meta=b"{}", payload_len=0):
    import xxhash
    head = struct.pack("<4sHHIIQQQ", b"TSKV", 1, kind, len(meta), flags, payload_len,
                       xxhash.xxh3_64_intdigest(meta), xxhash.xxh3_64_intdigest(b""))
    return head + xxhash.xxh3_64_intdigest(head).to_bytes(8, "little") + meta


@pytest.mark.parametrize("raw,fault", [
    (_forged(kind=99), ProtocolFault.UNKNOWN_OP),
    (_forged(flags=1), ProtocolFault.MALFORMED),
    (_forged(meta=b"[1]"), ProtocolFault.MALFORMED),
    (_forged(meta=b"\xff{"), ProtocolFault.MALFORMED),
    (_forged(payload_len=1 << 40), ProtocolFault.OVERSIZE),
    (_forged()[:30], ProtocolFault.TRUNCATED),
    (_forged(payload_len=10), ProtocolFault.TRUNCATED),
])
def test_malformed_refused(raw, fault):
    with pytest.raises(ProtocolError) as e:
        _feed(Decoder(WireLimits(max_meta=64, max_payload=1 << 20)), raw)
    assert e.value.fault is fault


def test_limits_validated():
    with pytest.raises(UsageError) as e:
        WireLimits(max_meta=0)
    assert e.value.argument == "max_meta"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.integers(1, 64))
def test_fuzz_never_crashes(data, step):
    valid = _bytes(Kind.DONE, {"x": 1})
    for blob in (data, valid[:10] + data, valid + data):
        try:
            _feed(Decoder(WireLimits(max_meta=1024, max_payload=4096)), blob, step)
        except ProtocolError:
            pass
