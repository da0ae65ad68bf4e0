"""Refused calls name their argument; bad peers and bad frames close the connection, never crash."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiersync.disagg import (
    DisaggConfig,
    KVConsumer,
    KVOrder,
    KVProducer,
    PagedKVLayout,
    RequestState,
    SourceSpec,
)
from tiersync.disagg.ops import KV, KvDone, KvLayer, KvNext, KvOpen, KvOpened, KvPull
from tiersync.disagg.reshard import default_planner, route_digest
from tiersync.errors import ClosedError, UsageError
from tiersync.net import events as ev
from tiersync.net.errors import NetTimeoutError, PeerClosedError, ProtocolError, RequestError
from tiersync.net.server import TcpServer
from tiersync.net.service import Service
from tiersync.net.tcp import TcpConfig, TcpTransport

LAYOUT = PagedKVLayout(
    num_layers=2,
    num_kv_heads=2,
    head_dim=4,
    block_size=4,
    num_blocks=8,
    dtype="float32",
    tp_size=1,
    order=KVOrder.BLOCK_MAJOR,
)


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
    assert (
        _arg(consumer.start_read, "r", SourceSpec(other, (producer.address,), (0, 1), 8), [0, 1], _layers())
        == "dst.head_dim"
    )
    assert consumer.get("r") is None
    assert _arg(SourceSpec, LAYOUT, ("a:1", "b:2"), (0,), 1) == "source.addresses"
    assert _arg(SourceSpec, LAYOUT, ("nohost",), (0,), 1) == "source.addresses[0]"
    assert _arg(SourceSpec.from_dict, {"layout": 1}) == "source"
    assert _arg(KVConsumer, LAYOUT, 1) == "rank"
    consumer.close()
    with pytest.raises(ClosedError):
        consumer.start_read("r", source, [0, 1], _layers())


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"timeout_s": 0}, "timeout_s"),
        ({"token": b"short"}, "token"),
        ({"chunk_bytes": 0}, "chunk_bytes"),
        ({"chunk_bytes": 2 << 30}, "chunk_bytes"),
        ({"route": "shm"}, "route"),
        ({"tls": "yes"}, "tls"),
        ({"window": 0}, "window"),
        ({"connect_timeout_s": True}, "connect_timeout_s"),
        ({"io_timeout_s": -1.0}, "io_timeout_s"),
    ],
)
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
        assert reply == b"" or reply[:4] == b"TSYN"  # an ERROR frame at most, then close
    landing = _layers()
    h = KVConsumer(LAYOUT, 0).start_read("g", SourceSpec(LAYOUT, (producer.address,), (1, 2), 8), [3, 4], landing)
    assert h.wait(20) is RequestState.DONE
    nb = LAYOUT.block_nbytes
    for layer in range(2):  # block-major: K,V of block 1..2 -> blocks 3..4, contiguous
        np.testing.assert_array_equal(landing[layer][3 * 2 * nb : 5 * 2 * nb], src[1 * 2 * nb : 3 * 2 * nb])
        assert not landing[layer][: 3 * 2 * nb].any() and not landing[layer][5 * 2 * nb :].any()
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


ROUTE = default_planner().plan(LAYOUT, LAYOUT, (0, 1), (0, 1), 8).route_spans(0, 0)
ROUTE_BYTES, ROUTE_DIGEST = int(ROUTE[:, 2].sum()), route_digest(ROUTE)


class _Liar(Service):
    """A producer on the real stack that answers with ``lies[op]`` (or the truth)."""

    vocabulary = KV

    def __init__(self, **lies) -> None:
        self.lies = lies

    def handle(self, session, event):
        name = type(event).__name__
        if name in self.lies:
            return [self.lies[name](event)]
        if isinstance(event, KvOpen):
            return [KvOpened(event.request_id, ROUTE_BYTES, ROUTE_DIGEST)]
        if isinstance(event, KvNext):
            return [KvLayer(event.request_id, event.n)]
        if isinstance(event, KvPull):
            return [ev.Data(event.request_id, bytes(event.length))]
        return [ev.CommitReply(event.request_id, ev.CommitStatus.COMMITTED)]


_LIAR_MEMORY = np.full(LAYOUT.layer_nbytes + 64, 7, np.uint8)


def _local_reply(event, checksum, extra=0):
    import os

    from tiersync.net.frames import SUPPORTED, payload_checksum
    from tiersync.net.local import buffer_address

    n = event.length + extra
    value = payload_checksum(SUPPORTED[0], _LIAR_MEMORY[:n]) if checksum is None else checksum
    return ev.LocalReply(event.request_id, os.getpid(), SUPPORTED[0], ((buffer_address(_LIAR_MEMORY)[0], n, value),))


def _garbage_server():
    srv = socket.create_server(("127.0.0.1", 0))

    def run():
        conn, _ = srv.accept()
        with conn:
            conn.sendall(b"\x01" * 200)
            conn.recv(1)
        srv.close()

    threading.Thread(target=run, daemon=True).start()
    return f"127.0.0.1:{srv.getsockname()[1]}"


@pytest.mark.parametrize(
    "lies",
    [
        None,  # garbage instead of a handshake
        {"KvOpen": lambda e: KvOpened(e.request_id, 7, ROUTE_DIGEST)},  # a route size that does not fit the plan
        {"KvOpen": lambda e: KvOpened(e.request_id, ROUTE_BYTES, ROUTE_DIGEST ^ 1)},  # its size, other spans
        {"KvNext": lambda e: KvLayer(e.request_id, 9)},  # layer out of range
        {"KvNext": lambda e: KvLayer(e.request_id, 0)},  # the same layer twice
        {"KvPull": lambda e: ev.Data(e.request_id, b"1234567")},  # a DATA of the wrong size
        {"KvPullLocal": lambda e: _local_reply(e, 12345)},  # same host: bytes that do not match their checksum
        {"KvPullLocal": lambda e: _local_reply(e, None, extra=8)},  # same host: regions longer than the pull
    ],
)
def test_consumer_fails_on_bad_answers(lies):
    server = None if lies is None else TcpServer("127.0.0.1:0", _Liar(**lies))
    address = _garbage_server() if server is None else server.address
    route = "local" if lies and "KvPullLocal" in lies else "tcp"
    consumer = KVConsumer(LAYOUT, 0, DisaggConfig(timeout_s=20, route=route))
    landing = _layers()
    try:
        h = consumer.start_read("b", SourceSpec(LAYOUT, (address,), (0, 1), 8), [0, 1], landing)
        assert h.wait(20) is RequestState.FAILED
        assert isinstance(h.error, ProtocolError)
        assert not any(buf.any() for buf in landing[1:])  # nothing after the bad answer was landed
        assert consumer.poll().failed_receiving == {"b"}
    finally:
        consumer.close()
        if server is not None:
            server.close()


def test_uncounted_done_fails_the_read():
    server = TcpServer(
        "127.0.0.1:0", _Liar(KvDone=lambda e: ev.CommitReply(e.request_id, ev.CommitStatus.FAILED, "late"))
    )
    with KVConsumer(LAYOUT, 0, DisaggConfig(timeout_s=20, route="tcp")) as consumer:
        h = consumer.start_read("c", SourceSpec(LAYOUT, (server.address,), (0, 1), 8), [0, 1], _layers())
        assert h.wait(20) is RequestState.FAILED and "did not count" in str(h.error)
    server.close()


def _raw_reader(producer, read):
    channel = TcpTransport(TcpConfig(), KV).connect(producer.address)
    plan = default_planner().plan(
        read.src_layout, read.dst_layout, read.src_block_ids, read.dst_block_ids, read.num_tokens
    )
    spans = plan.route_spans(read.src_rank, read.dst_rank)
    assert int(spans[:, 2].sum()) == ROUTE_BYTES // 2
    assert channel.request(KvOpen(channel.new_request_id(), read)) == KvOpened(1, ROUTE_BYTES // 2, route_digest(spans))
    return channel


def test_ack_after_producer_deadline_is_failed_not_done():
    import time

    from tiersync.disagg.messages import ReadRequest

    with KVProducer(LAYOUT, 0, DisaggConfig(timeout_s=1.0)) as producer:
        src = np.arange(LAYOUT.layer_nbytes, dtype=np.uint8)
        registered = time.monotonic()
        producer.register("x", [0], 4, [src, src])
        producer.layer_ready("x", 0)
        producer.layer_ready("x", 1)
        channel = _raw_reader(producer, ReadRequest("x", 0, 0, LAYOUT, (1,), (0,), 4, LAYOUT))
        assert [channel.request(KvNext(channel.new_request_id(), n)).layer for n in range(2)] == [0, 1]
        time.sleep(max(0.0, registered + 1.2 - time.monotonic()))  # let the producer's timeout pass
        try:  # every byte could have been read, but the ack comes too late
            reply = channel.request(KvDone(channel.new_request_id()))
            assert reply.status is ev.CommitStatus.FAILED
        except (PeerClosedError, RequestError):
            pass
        channel.close()
        status = producer.poll()
        assert status.failed_sending == {"x"} and not status.done_sending
        assert producer.state("x") is RequestState.FAILED


def test_out_of_protocol_requests_refused_and_session_kept(producer):
    from tiersync.disagg.messages import ReadRequest
    from tiersync.net.fields import ErrorCode

    src = np.arange(LAYOUT.layer_nbytes, dtype=np.uint8)
    producer.register("o", [0], 4, [src, src])
    channel = TcpTransport(TcpConfig(), KV).connect(producer.address)
    with pytest.raises(RequestError) as e:  # nothing open yet
        channel.request(KvNext(channel.new_request_id(), 0))
    assert e.value.code is ErrorCode.BAD_REQUEST
    channel.request(KvOpen(channel.new_request_id(), ReadRequest("o", 0, 0, LAYOUT, (1,), (0,), 4, LAYOUT)))
    for bad in (
        KvNext(channel.new_request_id(), 1),  # out of order
        KvPull(channel.new_request_id(), 0, 0, 8),
    ):  # layer not announced
        with pytest.raises(RequestError) as e:
            channel.request(bad)
        assert e.value.code is ErrorCode.BAD_REQUEST and not channel.closed  # refused, session kept
    producer.layer_ready("o", 1)
    assert channel.request(KvNext(channel.new_request_id(), 0)).layer == 1
    with pytest.raises(RequestError):  # past the route
        channel.request(KvPull(channel.new_request_id(), 1, ROUTE_BYTES, 8))
    assert producer.state("o") is RequestState.PENDING  # a refused request changed nothing
    channel.close()  # the reader leaves before it is done: the request fails
    assert _poll_until(producer, "o").failed_sending == {"o"}


def test_a_reader_beyond_any_reshard_is_refused_before_planning_and_changes_nothing(producer):
    """KV_OPEN's layout comes off the wire: a destination rank outside its TP size, or a TP size
    no reshard of this layout needs (one route per destination rank: a few hundred bytes could
    make the producer plan millions), is refused BAD_REQUEST before any planning, and the
    request still takes the honest reader afterwards (a refused reader changes nothing)."""
    from dataclasses import replace

    from tiersync.disagg.messages import ReadRequest
    from tiersync.net.fields import ErrorCode

    src = np.arange(LAYOUT.layer_nbytes, dtype=np.uint8)
    producer.register("t", [0], 4, [src, src])
    planned = len(default_planner())
    channel = TcpTransport(TcpConfig(), KV).connect(producer.address)
    for layout, rank in ((replace(LAYOUT, tp_size=2), 5), (replace(LAYOUT, tp_size=1 << 16), 0)):
        with pytest.raises(RequestError) as e:
            channel.request(KvOpen(channel.new_request_id(), ReadRequest("t", 0, rank, layout, (0,), (0,), 4, LAYOUT)))
        assert e.value.code is ErrorCode.BAD_REQUEST and not channel.closed
    assert len(default_planner()) == planned  # nothing was planned for them
    opened = channel.request(KvOpen(channel.new_request_id(), ReadRequest("t", 0, 0, LAYOUT, (0,), (0,), 4, LAYOUT)))
    assert opened.route_bytes > 0
    channel.close()


class _Staller(_Liar):
    """Answers ``op`` like ``answer`` only once ``release`` is set (a producer that stops
    mid-read), as the producer's waiting answers do: a generator, so the answers before it
    were sent."""

    def __init__(self, op: str, answer, release: threading.Event) -> None:
        super().__init__()
        self.op, self.answer, self.release = op, answer, release

    def handle(self, session, event):
        if type(event).__name__ != self.op:
            return super().handle(session, event)
        return self._stall(event)

    def _stall(self, event):
        self.release.wait(60)
        yield self.answer(event)


_STALLED = {
    "KvPull": lambda e: ev.Data(e.request_id, bytes(e.length)),
    "KvPullLocal": lambda e: _local_reply(e, None),
    "KvDone": lambda e: ev.CommitReply(e.request_id, ev.CommitStatus.COMMITTED),
}


@pytest.mark.parametrize(("route", "op"), [("tcp", "KvPull"), ("local", "KvPullLocal"), ("tcp", "KvDone")])
def test_a_producer_that_stops_answering_pulls_fails_the_read_after_io_timeout(route, op):
    """Every step of a read, the last KV_DONE too (before: that one waited the read's whole
    deadline), fails after ``io_timeout_s`` when the producer stops answering it."""
    release = threading.Event()
    answer = _STALLED[op]
    server = TcpServer("127.0.0.1:0", _Staller(op, answer, release))
    consumer = KVConsumer(LAYOUT, 0, DisaggConfig(timeout_s=60, io_timeout_s=0.5, route=route))
    try:
        h = consumer.start_read("s", SourceSpec(LAYOUT, (server.address,), (0, 1), 8), [0, 1], _layers())
        assert h.wait(20) is RequestState.FAILED  # the read's own deadline (60 s) is far off
        assert isinstance(h.error, NetTimeoutError) and h.error.context["timeout_s"] == 0.5
    finally:
        release.set()
        consumer.close()
        server.close()


def test_a_layer_computed_for_longer_than_io_timeout_still_lands():
    slow_layer = threading.Event()  # never set: each KV_NEXT waits out its second, as a prefill would
    server = TcpServer(
        "127.0.0.1:0",
        _Liar(KvNext=lambda e: (slow_layer.wait(1.0), KvLayer(e.request_id, e.n))[1]),
    )
    landing = [np.full(LAYOUT.layer_nbytes, 9, np.uint8) for _ in range(LAYOUT.num_layers)]
    try:
        with KVConsumer(LAYOUT, 0, DisaggConfig(timeout_s=60, io_timeout_s=0.3, route="tcp")) as consumer:
            h = consumer.start_read("w", SourceSpec(LAYOUT, (server.address,), (0, 1), 8), [0, 1], landing)
            assert h.wait(20) is RequestState.DONE, h.error
        assert not any(buf[: 2 * 2 * 4 * 4 * 4 * 2].any() for buf in landing)  # the liar's zeros landed
    finally:
        server.close()


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(field=st.sampled_from(["layout", "addresses", "block_ids", "num_tokens"]), value=_JSON)
def test_a_source_description_from_a_client_is_a_source_or_a_usage_error(field, value):
    """kv_transfer_params come from any API client of the decode engine: whatever JSON stands in
    one field, SourceSpec.from_dict answers a SourceSpec or UsageError (a TypeError or bare
    ValueError, e.g. from ``"addresses": 5`` or ``"block_ids": ["a"]``, escaped the decode
    scheduler's check and ended the engine)."""
    good = SourceSpec(LAYOUT, ("127.0.0.1:1",), (0, 1), 8).to_dict()
    try:
        SourceSpec.from_dict(good | {field: value})
    except UsageError:
        pass


def test_block_ids_may_be_a_numpy_array_of_ints():
    spec = SourceSpec(LAYOUT, ("127.0.0.1:1",), np.array([0, 1], dtype=np.int64), 8)
    assert spec.block_ids == (0, 1) and all(type(b) is int for b in spec.block_ids)


@pytest.mark.parametrize(
    "field,value",
    [("addresses", 5), ("block_ids", ["a"]), ("block_ids", [None]), ("block_ids", [-1]), ("block_ids", [True])],
)
def test_malformed_fields_of_a_source_are_usage_errors_naming_them(field, value):
    good = SourceSpec(LAYOUT, ("127.0.0.1:1",), (0, 1), 8).to_dict()
    assert _arg(SourceSpec.from_dict, good | {field: value}).startswith(f"source.{field}")


def test_a_reader_that_planned_with_another_source_layout_is_refused_not_served(producer):
    """The source description (kv_transfer_params: any client's) names the prefill layout the
    reader plans with. The same bytes in another order moved as many route bytes, so the read
    was DONE with the prefill's blocks landed permuted; now the producer refuses the KV_OPEN."""
    import dataclasses

    layers = [np.arange(LAYOUT.layer_nbytes, dtype=np.uint32).astype(np.uint8) for _ in range(LAYOUT.num_layers)]
    producer.register("p", [0, 1], 8, layers)
    for layer in range(LAYOUT.num_layers):
        producer.layer_ready("p", layer)
    other = dataclasses.replace(LAYOUT, order=KVOrder.HEAD_MAJOR)
    with KVConsumer(LAYOUT, 0, DisaggConfig(timeout_s=30)) as consumer:
        landing = _layers()
        handle = consumer.start_read("p", SourceSpec(other, (producer.address,), (0, 1), 8), [0, 1], landing)
        assert handle.wait(20) is RequestState.FAILED
        assert "another layout" in str(handle.error)
        assert not any(landing[i].any() for i in range(LAYOUT.num_layers))


def test_a_channel_a_failed_read_took_to_close_is_not_given_back_to_the_pool(producer):
    """A read's pulling thread returns its channel through ``_detach``: True while the read
    owns it (back to the pool); False once the read failed and took it to close, so the thread
    closes it too instead of pooling it (another request took it, then it was closed under it)."""
    from tiersync.errors import RemoteError

    class Channel:
        closed = False

        def close(self):
            self.closed = True

    producer.register("slow", [0, 1], 8, _layers())  # no layer ever ready: the read stays PENDING
    with KVConsumer(LAYOUT, 0, DisaggConfig(timeout_s=30)) as consumer:
        handle = consumer.start_read("slow", SourceSpec(LAYOUT, (producer.address,), (0, 1), 8), [0, 1], _layers())
        kept, taken = Channel(), Channel()
        assert handle._attach(kept) and handle._detach(kept) and not kept.closed
        assert handle._attach(taken)
        handle._fail(RemoteError("another source failed", peer="p"))
        assert taken.closed and handle._detach(taken) is False


def test_a_read_whose_thread_cannot_start_fails_and_is_reported(monkeypatch):
    """No thread left to be had (``can't start new thread``): start_read still returns its
    handle, the read is FAILED and poll reports it, so the engine frees its blocks. Before, the
    RuntimeError left the read counted as pulling, never reported."""
    from tiersync.disagg import consumer as consumer_module

    class NoThread(threading.Thread):
        def start(self) -> None:
            raise RuntimeError("can't start new thread")

    monkeypatch.setattr(consumer_module.threading, "Thread", NoThread)
    landing = [np.zeros(LAYOUT.layer_nbytes, np.uint8) for _ in range(LAYOUT.num_layers)]
    with KVConsumer(LAYOUT, 0, DisaggConfig()) as consumer:
        handle = consumer.start_read("r", SourceSpec(LAYOUT, ["127.0.0.1:1"], [0, 1], 8), [2, 3], landing)
        assert handle.wait(5) is RequestState.FAILED and "reader thread" in str(handle.error)
        assert consumer.poll().failed_receiving == {"r"}
