"""Refused calls name their argument; bad peers and bad frames close the connection, never crash."""
from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from tiersync.disagg import DisaggConfig, KVConsumer, KVOrder, KVProducer, PagedKVLayout, RequestState, SourceSpec
from tiersync.disagg.conn import FrameSocket
from tiersync.disagg.wire import Kind, WireLimits
from tiersync.errors import ClosedError, UsageError
from tiersync.net.errors import PeerClosedError, ProtocolError, RequestError

LAYOUT = PagedKVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, num_blocks=8, dtype="float32",
                       tp_size=1, order=KVOrder.BLOCK_MAJOR)


def _layers(writable=True):
    return [np.zeros(LAYOUT.layer_nbytes, np.uint8) for _ in range(LAYOUT.num_layers)]


@pytest.fixture
def producer():
    with KVProducer(LAYOUT, 0, DisaggConfig(timeout_s=30)) as p:
        yield p


def _arg(fn, *args, **kwargs):
    with pytest.raises(UsageError) as e:
        fn(*args, **kwargs)
    return e.value.argument


def test_register_refusals_leave_state_unchanged(producer):
    assert _arg(producer.register, "", [0], 4, _layers()) == "request_id"
    assert _arg(producer.register, "r", [0], 5, _layers()) == "block_ids"  # 5 tokens need 2 blocks
    assert _arg(producer.register, "r", [0, 8], 5, _layers()) == "block_ids"
    assert _arg(producer.register, "r", [0], 0, _layers()) == "num_tokens"
    assert _arg(producer.register, "r", [0], 4, _layers()[:1]) == "layers"
    bad = _layers()
    bad[1] = np.zeros(LAYOUT.layer_nbytes + 1, np.uint8)
    assert _arg(producer.register, "r", [0], 4, bad) == "layers[1]"
    assert producer.state("r") is None
    producer.register("r", [0], 4, _layers())
    assert _arg(producer.register, "r", [0], 4, _layers()) == "request_id"
    assert _arg(producer.layer_ready, "r", 2) == "layer"
    assert _arg(producer.layer_ready, "zz", 0) == "request_id"
    assert producer.layer_ready("r", 0) and producer.layer_ready("r", 0)
    producer.abort("r")
    assert producer.poll().failed_sending == {"r"}
    assert producer.layer_ready("r", 1) is False  # late call after the report: a no-op
    assert producer.state("r") is RequestState.FAILED


def test_start_read_refusals(producer):
    consumer = KVConsumer(LAYOUT, 0)
    source = SourceSpec(LAYOUT, (producer.address,), (0, 1), 8)
    assert _arg(consumer.start_read, "r", "src", [0, 1], _layers()) == "source"
    assert _arg(consumer.start_read, "r", source, [0], _layers()) == "dst_block_ids"
    assert _arg(consumer.start_read, "r", source, [0, 1], _layers()[:1]) == "landing"
    ro = _layers()
    ro[0].setflags(write=False)
    assert _arg(consumer.start_read, "r", source, [0, 1], ro) == "landing[0]"
    other = PagedKVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=8)
    assert _arg(consumer.start_read, "r", SourceSpec(other, (producer.address,), (0, 1), 8),
                [0, 1], _layers()) == "dst.head_dim"
    assert consumer.get("r") is None
    assert _arg(SourceSpec, LAYOUT, ("a:1", "b:2"), (0,), 1) == "source.addresses"
    assert _arg(SourceSpec, LAYOUT, ("nohost",), (0,), 1) == "source.addresses[0]"
    assert _arg(SourceSpec.from_dict, {"layout": 1}) == "source"
    assert _arg(KVConsumer, LAYOUT, 1) == "rank"
    consumer.close()
    with pytest.raises(ClosedError):
        consumer.start_read("r", source, [0, 1], _layers())


@pytest.mark.parametrize("kwargs,name", [
    ({"timeout_s": 0}, "timeout_s"), ({"token": b"short"}, "token"), ({"chunk_bytes": 0}, "chunk_bytes"),
    ({"chunk_bytes": 2 << 30}, "chunk_bytes"), ({"limits": 3}, "limits"), ({"connect_timeout_s": True}, "connect_timeout_s"),
])
def test_config_validated(kwargs, name):
    assert _arg(DisaggConfig, **kwargs) == name


def test_garbage_closes_connection_and_producer_keeps_serving(producer):
    src = np.arange(LAYOUT.layer_nbytes, dtype=np.uint8)
    producer.register("g", [1, 2], 8, [src, src])
    producer.layer_ready("g", 0)
    producer.layer_ready("g", 1)
    host, port = producer.address.split(":")
    for junk in (b"GET / HTTP/1.1\r\n\r\n" + b"x" * 64, b"\0" * 48, b"TSKV"):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            reply = b""
            try:
                s.sendall(junk)
                s.shutdown(socket.SHUT_WR)
                while chunk := s.recv(4096):
                    reply += chunk
            except OSError:  # closed with our junk still unread (RST): also a close
                pass
        assert reply == b"" or reply[:4] == b"TSKV"  # an ERROR frame at most, then close
    landing = _layers()
    h = KVConsumer(LAYOUT, 0).start_read("g", SourceSpec(LAYOUT, (producer.address,), (1, 2), 8), [3, 4], landing)
    assert h.wait(20) is RequestState.DONE
    nb = LAYOUT.block_nbytes
    for l in range(2):  # block-major: K,V of block 1..2 -> blocks 3..4, contiguous
        np.testing.assert_array_equal(landing[l][3 * 2 * nb:5 * 2 * nb], src[1 * 2 * nb:3 * 2 * nb])
        assert not landing[l][: 3 * 2 * nb].any() and not landing[l][5 * 2 * nb:].any()
    assert _poll_until(producer, "g").done_sending == {"g"}  # the reader's DONE ack lands after its own DONE


def _poll_until(producer, request_id, timeout=20.0):
    """Poll the producer until ``request_id`` is reported (polling a status, not timing)."""
    import time
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        status = producer.poll()
        if request_id in status.done_sending | status.failed_sending:
            return status
        time.sleep(0.02)
    raise AssertionError(f"{request_id} never reported")


def _fake_producer(behaviour):
    """A raw TCP server that answers the handshake, then misbehaves; returns its address."""
    srv = socket.create_server(("127.0.0.1", 0))

    def run():
        conn, _ = srv.accept()
        fs = FrameSocket(conn, "client", WireLimits())
        import time
        deadline = time.monotonic() + 10
        from tiersync.disagg.conn import server_handshake
        server_handshake(fs, None, deadline)
        fs.expect(Kind.READ, deadline)
        behaviour(fs, deadline)
        try:
            conn.recv(1)
        finally:
            fs.close()
            srv.close()

    threading.Thread(target=run, daemon=True).start()
    return f"127.0.0.1:{srv.getsockname()[1]}"


@pytest.mark.parametrize("behaviour", [
    lambda fs, d: fs.sock.sendall(b"\x01" * 200),  # garbage
    lambda fs, d: fs.send(Kind.LAYER, {"layer": 0, "offset": 0, "total": 7}, d, [b"1234567"]),  # wrong size
    lambda fs, d: fs.send(Kind.LAYER, {"layer": 9, "offset": 0, "total": LAYOUT.layer_nbytes // 4}, d,
                          [bytes(LAYOUT.layer_nbytes // 4)]),  # layer out of range
    lambda fs, d: fs.send(Kind.LAYER, {"layer": "x"}, d),  # malformed metadata
])
def test_consumer_fails_on_bad_frames(behaviour):
    address = _fake_producer(behaviour)
    consumer = KVConsumer(LAYOUT, 0, DisaggConfig(timeout_s=20))
    landing = _layers()
    h = consumer.start_read("b", SourceSpec(LAYOUT, (address,), (0, 1), 8), [0, 1], landing)
    assert h.wait(20) is RequestState.FAILED
    assert isinstance(h.error, ProtocolError)
    assert not any(l.any() for l in landing)
    assert consumer.poll().failed_receiving == {"b"}


def _raw_reader(producer, read_meta, deadline):
    from tiersync.disagg.conn import client_handshake
    host, port = producer.address.split(":")
    fs = FrameSocket(socket.create_connection((host, int(port)), timeout=10), producer.address, WireLimits())
    client_handshake(fs, None, deadline)
    fs.send(Kind.READ, read_meta, deadline)
    return fs


def test_ack_after_producer_deadline_is_failed_not_done():
    import time
    from tiersync.disagg.messages import ReadRequest
    with KVProducer(LAYOUT, 0, DisaggConfig(timeout_s=1.0)) as producer:
        src = np.arange(LAYOUT.layer_nbytes, dtype=np.uint8)
        registered = time.monotonic()
        producer.register("x", [0], 4, [src, src])
        producer.layer_ready("x", 0)
        producer.layer_ready("x", 1)
        deadline = time.monotonic() + 10
        fs = _raw_reader(producer, ReadRequest("x", 0, 0, LAYOUT, (1,), (0,), 4).to_meta(), deadline)
        assert [fs.expect(Kind.LAYER, deadline).meta["layer"] for _ in range(2)] == [0, 1]
        time.sleep(max(0.0, registered + 1.2 - time.monotonic()))  # let the producer's timeout pass
        try:
            fs.send(Kind.DONE, {}, deadline)  # every byte was received, but the ack comes too late
        except PeerClosedError:
            pass
        with pytest.raises((PeerClosedError, ProtocolError, RequestError)):
            while True:
                fs.recv(deadline)
        fs.close()
        status = producer.poll()
        assert status.failed_sending == {"x"} and not status.done_sending
        assert producer.state("x") is RequestState.FAILED


def test_chunking_splits_and_joins_pieces():
    from tiersync.disagg.producer import _chunks
    pieces = [np.arange(n, dtype=np.uint8) for n in (5, 1, 9, 3)]
    groups = list(_chunks(pieces, 4))
    assert [off for off, _ in groups] == [0, 4, 8, 12, 16]
    assert all(sum(p.size for p in g) == 4 for _, g in groups[:-1])
    joined = np.concatenate([p for _, g in groups for p in g])
    np.testing.assert_array_equal(joined, np.concatenate(pieces))
