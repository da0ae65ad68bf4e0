"""The weight-sync ops on the one wire stack: round trips, fields validated on parse, spans
bounded, the vocabulary, and the version segment's header checks."""

from __future__ import annotations

import os
import struct
import threading

import numpy as np
import pytest

from tiersync.errors import UsageError
from tiersync.net import events as ev
from tiersync.net import store_ops as so
from tiersync.net.codec import MetaReader, MetaWriter
from tiersync.net.errors import ProtocolError, ProtocolFault
from tiersync.net.frames import EMPTY_CHECKSUM, Op, PayloadChecksum, ProtocolConfig, encode_header
from tiersync.net.protocol import Connection, Role
from tiersync.weights import Mesh, PlanOptions, Sharding
from tiersync.weights.config import MAX_SPAN_BYTES, TransportKind
from tiersync.weights.manifest import Manifest
from tiersync.weights.ops import WEIGHTS, Ack, Announce, Get, Ready, Register, Release, Welcome
from tiersync.weights.segment import HEADER_BYTES, SegmentReader, SegmentWriter, tensor_offsets
from tiersync.weights.serving import span_payload
from tiersync.weights.spans import StridedSpan
from tiersync.weights.transfer_plan import TensorSpec


def _manifest() -> Manifest:
    sh = Sharding(Mesh((2,), ("fsdp",)), ("fsdp",))
    return Manifest(
        3,
        1,
        2,
        ("w",),
        (TensorSpec((4, 6), "float32"),),
        (sh,),
        (HEADER_BYTES,),
        4096,
        "/dev/shm/x",
        "host",
        PlanOptions(2, 1024),
        {0: "127.0.0.1:5"},
    )


def _roundtrip(event):
    rid = getattr(event, "request_id", 0)
    r = MetaReader(event.meta())
    got = type(event).parse(rid, r, ProtocolConfig())
    r.finish()
    return got


def test_every_op_round_trips_and_the_vocabulary_is_distinct():
    span = StridedSpan(8, 12, (3, 2), (48, 24))
    for event in (
        Register(1, "s-0", 2, "host/boot", TransportKind.AUTO, "127.0.0.1:9", True),
        Welcome(1, TransportKind.SHM, 0),
        Announce(_manifest()),
        Ready(3, 1),
        Ack(3, False, 0.25, "boom"),
        Release(3),
        Get(7, 3, "layer.0", (0, 6), span),
    ):
        assert _roundtrip(event) == event
    assert {int(o) for o in WEIGHTS.ops} >= set(range(48, 55)) and not {int(o) for o in Op} & set(range(48, 64))


def _ready(vocabulary) -> tuple[Connection, Connection]:
    client, server = Connection(Role.CLIENT, vocabulary=vocabulary), Connection(Role.SERVER, vocabulary=vocabulary)
    for src, dst, event in (
        (client, server, ev.Hello("c", b"c" * 16)),
        (server, client, ev.Challenge(b"s" * 16, b"")),
        (client, server, ev.Auth(b"")),
        (server, client, ev.Ready(1)),
    ):
        dst.receive_data(b"".join(bytes(b) for b in src.send(event)))
        assert isinstance(dst.next_event(), type(event))
    return client, server


def _get_meta(counts=(2,), strides=(10,), row=3, key=(0,)) -> bytes:
    return MetaWriter().u64(1).text("w").u64s(key).u64(0).u64(row).u64s(counts).u64s(strides).getvalue()


@pytest.mark.parametrize(
    "cls,meta",
    [
        (Get, _get_meta(row=0)),  # an empty row
        (Get, _get_meta(counts=(2, 3))),  # counts and strides disagree
        (Get, _get_meta(counts=(0,))),  # no rows
        (Get, _get_meta(counts=(1 << 20,), row=1 << 20)),  # over the largest span
        (Get, _get_meta(key=tuple(range(40)))),  # too many dimensions
        (Get, b"\x01\x02"),  # truncated
        (Register, MetaWriter().text("s").u64(0).text("h").text("carrier-pigeon").text("").u8(0).getvalue()),
        (Register, MetaWriter().text("s").u64(0).text("h").text("tcp").text("").u8(7).getvalue()),  # not a flag
        (Welcome, MetaWriter().text("auto").u64(0).getvalue()),  # a grant is SHM or TCP
        (Announce, MetaWriter().json({"version": 1}).getvalue()),  # a manifest missing fields
        (Announce, MetaWriter().blob(b"[1, 2]").getvalue()),
        (Ack, MetaWriter().u64(1).u8(1).f64(float("nan")).text("").getvalue()),
        (Get, _get_meta(counts=(1,), strides=((1 << 64) - 1,))),  # a stride numpy cannot address
        (Announce, MetaWriter().blob(b"[" * 100_000).getvalue()),  # JSON nested past the recursion limit
        (Announce, MetaWriter().json({**_manifest().to_json(), "peers": []}).getvalue()),  # peers not a map
        (Announce, MetaWriter().json({**_manifest().to_json(), "version": float("inf")}).getvalue()),
        (  # 4 MiB in 1-byte chunks: a sampler would plan for minutes
            Announce,
            MetaWriter()
            .json({**_manifest().to_json(), "tensors": [["w", [1 << 20, 4], "uint8"]], "segment_bytes": 1})
            .getvalue(),
        ),
    ],
)
def test_hostile_metadata_is_malformed_on_the_wire(cls, meta):
    client, server = _ready(WEIGHTS)
    dst, rid = server, 0 if cls in (Announce, Ack) else 1
    if cls is Welcome:  # an answer: the client must have asked
        client.send(Register(rid, "s", 0, "h", TransportKind.TCP))
        dst = client
    dst.receive_data(encode_header(cls.OP, rid, meta, 0, EMPTY_CHECKSUM[PayloadChecksum.XXH3_64]) + meta)
    with pytest.raises(ProtocolError) as e:
        dst.next_event()
    assert e.value.fault is ProtocolFault.MALFORMED


def test_a_weights_connection_refuses_another_services_ops():
    client, server = _ready(WEIGHTS)
    server.receive_data(b"".join(bytes(b) for b in client.send(Get(1, 2, "w", (0,), StridedSpan(0, 4)))))
    assert isinstance(server.next_event(), Get)
    store, _ = _ready(so.STORE)
    server.receive_data(b"".join(bytes(b) for b in store.send(so.Pull(2, 1, b"k" * 16, 0, 4))))
    with pytest.raises(ProtocolError) as e:
        server.next_event()
    assert e.value.fault is ProtocolFault.UNKNOWN_OP


def test_ops_validate_their_fields():
    for build, name in (
        (lambda: Get(1, 1, "w", (0,), StridedSpan(0, MAX_SPAN_BYTES + 1)), "span"),
        (lambda: Get(1, 1, "w", (-1,), StridedSpan(0, 4)), "key"),
        (lambda: Welcome(1, TransportKind.AUTO, 0), "transport"),
        (lambda: Announce({"version": 1}), "manifest"),
        (lambda: Ready(-1, 0), "version"),
    ):
        with pytest.raises(UsageError) as e:
            build()
        assert e.value.argument == name


def test_span_payload_and_bounds():
    shard = np.arange(64, dtype=np.uint8)
    span = StridedSpan(2, 3, (4,), (10,))
    assert b"".join(bytes(v) for v in span_payload(shard, span)) == bytes([2, 3, 4, 12, 13, 14, 22, 23, 24, 32, 33, 34])
    big = np.arange(1 << 20, dtype=np.uint8)
    views = span_payload(big, StridedSpan(0, 64 << 10, (4,), (128 << 10,)))  # few large rows: sent as views
    assert len(views) == 4 and all(v.obj is not None and len(v) == 64 << 10 for v in views)
    with pytest.raises(ProtocolError):
        span_payload(shard, StridedSpan(60, 8))


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


def test_a_segment_path_that_is_no_regular_file_is_refused_without_blocking(tmp_path):
    """The path comes from the trainer's manifest: a FIFO (whose open would wait for a writer
    forever), a device and a symbolic link to a real segment are each an IntegrityError."""
    from tiersync.errors import IntegrityError

    _, payload = tensor_offsets([4096])
    fifo, link, real = tmp_path / "fifo", tmp_path / "link", str(tmp_path / "seg")
    os.mkfifo(fifo)
    w = SegmentWriter(real, payload)
    os.symlink(real, link)
    refused = []

    def attach() -> None:
        for path in (str(fifo), "/dev/zero", str(link)):
            with pytest.raises(IntegrityError):
                SegmentReader(path, payload)
            refused.append(path)

    try:
        t = threading.Thread(target=attach, daemon=True)
        t.start()
        t.join(30)
        assert len(refused) == 3, refused  # a blocked open never returns
        SegmentReader(real, payload).close()
    finally:
        w.close()


def test_span_sums_are_computed_once_for_receivers_asking_at_once(monkeypatch):
    from tiersync.weights import serving

    calls = []
    real = serving.sum_of
    monkeypatch.setattr(serving, "sum_of", lambda algo, parts: calls.append(1) or real(algo, parts))
    sums, shard = serving._Sums(), np.random.default_rng(1).integers(0, 255, 16 << 20, dtype=np.uint8)
    span = StridedSpan(0, shard.size)
    payload = span_payload(shard, span)
    start, got = threading.Barrier(6), []

    def receiver(rid: int) -> None:
        start.wait()
        got.append(sums.of(Get(rid, 4, "w", (0,), span), payload))

    threads = [threading.Thread(target=receiver, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(got)) == 1
    assert got[0] == (serving.SUPPORTED[0], real(serving.SUPPORTED[0], payload))
    sums.of(Get(9, 3, "w", (0,), span), payload)  # an older version: summed, never kept
    sums.of(Get(10, 3, "w", (0,), span), payload)
    assert len(calls) == 3
    sums.of(Get(11, 4, "w", (0,), span), payload)  # the newest version's sum stays known
    assert len(calls) == 3


def test_span_sums_are_kept_per_trainer_incarnation(monkeypatch):
    """A relay serves every shard of a trainer (one incarnation each) and, after a restart, a
    trainer that numbers its versions again with other bytes: a sum is never answered for the
    bytes of another incarnation's same-numbered version, and alternating shards keep theirs."""
    from tiersync.weights import serving

    calls = []
    real = serving.sum_of
    monkeypatch.setattr(serving, "sum_of", lambda algo, parts: calls.append(1) or real(algo, parts))
    sums, span = serving._Sums(), StridedSpan(0, 4096)
    old, new = np.arange(4096, dtype=np.uint8), np.arange(4096, dtype=np.uint8)[::-1].copy()
    want = {id(b): (serving.SUPPORTED[0], real(serving.SUPPORTED[0], span_payload(b, span))) for b in (old, new)}
    assert sums.of(Get(1, 2, "w", (0,), span, 0xA), span_payload(old, span)) == want[id(old)]
    assert (
        sums.of(Get(2, 2, "w", (0,), span, 0xB), span_payload(new, span)) == want[id(new)]
    )  # restarted: version 2 again
    for rid in range(3, 7):  # both stay known: the old process's shard and the new one's
        inc, data = (0xA, old) if rid % 2 else (0xB, new)
        assert sums.of(Get(rid, 2, "w", (0,), span, inc), span_payload(data, span)) == want[id(data)]
    assert len(calls) == 2
    sums.of(Get(7, 3, "w", (0,), span, 0xB), span_payload(new, span))  # 0xB moved on; 0xA's sum stays
    assert sums.of(Get(8, 2, "w", (0,), span, 0xA), span_payload(old, span)) == want[id(old)] and len(calls) == 3


def test_a_span_whose_sum_failed_is_not_left_busy(monkeypatch):
    from tiersync.weights import serving

    real, fail = serving.sum_of, [True]

    def flaky(algo, parts):
        if fail.pop() if fail else False:
            raise MemoryError("no room")
        return real(algo, parts)

    monkeypatch.setattr(serving, "sum_of", flaky)
    sums, shard = serving._Sums(), np.arange(4096, dtype=np.uint8)
    span = StridedSpan(0, shard.size)
    payload = span_payload(shard, span)
    with pytest.raises(MemoryError):
        sums.of(Get(1, 4, "w", (0,), span), payload)
    assert not sums._busy  # a later GET sums it at once instead of waiting for the failed one
    assert sums.of(Get(2, 4, "w", (0,), span), payload) == (serving.SUPPORTED[0], real(serving.SUPPORTED[0], payload))


def test_a_w_sums_may_not_ask_the_trainer_to_read_more_than_the_tensor():
    """W_SUMS over a real connection: a sampler's chunks are summed; spans covering more bytes
    than the tensor in all (a few bytes of request, the whole tensor read for each span) get
    an ERROR, and the session answers on."""
    from tiersync.net.errors import RequestError
    from tiersync.net.tcp import TcpConfig, TcpTransport
    from tiersync.transfer import kernel
    from tiersync.weights.ops import Sums, SumsReply
    from tiersync.weights.serving import SpanService

    shard = np.random.default_rng(5).integers(0, 255, 1 << 20, dtype=np.uint8)
    service = SpanService(lambda v, t, k, s: (shard, lambda: None), 5.0, control=lambda s, e: [])
    transport = TcpTransport(TcpConfig(token=b"w" * 32), WEIGHTS)
    server = transport.serve("127.0.0.1:0", service)
    try:
        ch = transport.connect(server.address)
        half = 1 << 19
        whole = StridedSpan(0, 1 << 20)
        with pytest.raises(RequestError, match="more bytes than the tensor"):
            ch.request(Sums(ch.new_request_id(), 1, "w", (whole,) * 64))
        reply = ch.request(Sums(ch.new_request_id(), 1, "w", (StridedSpan(0, half), StridedSpan(half, half))))
        assert isinstance(reply, SumsReply) and reply.algo == int(ch.payload_checksum)
        if reply.algo == int(PayloadChecksum.TSUM64):
            assert reply.sums == (kernel.tsum64(shard[:half].data), kernel.tsum64(shard[half:].data))
        ch.close()
    finally:
        server.close()


@pytest.mark.parametrize(
    ("pinned", "mode", "by_reference"),
    [(True, "ALWAYS", True), (False, "ALWAYS", False), (True, "AUTO", False), (True, "NEVER", False)],
)
def test_a_pinned_answer_changed_before_it_was_read_is_refused_never_taken(pinned, mode, by_reference):
    """A trainer's DATA goes by reference (``SpanService(pinned=True)``, ``ByReference.ALWAYS``):
    the sampler reads the trainer's pages when it reads the socket. Bytes changed after the
    answer was written but before it was read reach the sampler as a frame it refuses
    (BAD_CHECKSUM: the sum was taken of the bytes as they were), never as other bytes; copied
    (not pinned; ``NEVER``; ``AUTO`` to this peer on the loopback), the old bytes arrive."""
    from tiersync.net.config import ByReference, TcpConfig
    from tiersync.net.socket_io import _wire
    from tiersync.net.tcp import TcpTransport
    from tiersync.weights.serving import SpanService

    if by_reference and _wire is None:
        pytest.skip("the native extension is not built here")
    shard = np.random.default_rng(5).integers(0, 255, 256 << 10, dtype=np.uint8)  # queued whole, unread
    before, written = shard.copy(), threading.Event()

    def release() -> None:  # runs once the answer was written: the sampler has not read it yet
        shard[:] = 7
        written.set()

    transport = TcpTransport(TcpConfig(token=b"k" * 32, by_reference=ByReference[mode]), WEIGHTS)
    server = transport.serve("127.0.0.1:0", SpanService(lambda *_: (shard, release), 5.0, pinned=pinned))
    channel = transport.connect(server.address)
    try:
        rid = channel.new_request_id()
        channel.send(Get(rid, 1, "w", (0,), StridedSpan(0, shard.size)))
        assert written.wait(10)
        if by_reference:
            with pytest.raises(ProtocolError) as info:
                channel.next_answer(rid, timeout=10)
            assert info.value.fault is ProtocolFault.BAD_CHECKSUM
        else:
            answer = channel.next_answer(rid, timeout=10)
            assert isinstance(answer, ev.Data) and bytes(answer.payload) == before.tobytes()
    finally:
        channel.close()
        server.close()


def test_a_get_whose_version_moved_on_while_it_was_summed_is_refused():
    """The checksum of a span no write-time sum covers is taken from its bytes: when the next
    version began meanwhile (and may be writing over them), the GET is refused, never answered
    with bytes and a sum of a mix of two versions."""
    from tiersync.net.config import TcpConfig
    from tiersync.net.errors import RequestError
    from tiersync.net.tcp import TcpTransport
    from tiersync.weights.ops import Sums, SumsReply
    from tiersync.weights.serving import SpanService

    shard, current = np.arange(4096, dtype=np.uint8), [1]
    control = lambda _session, _event: []  # noqa: E731 - a trainer shard's: W_SUMS is answered
    service = SpanService(lambda *_: (shard, lambda: None), 5.0, control, serving=lambda v: v == current[0])
    transport = TcpTransport(TcpConfig(token=b"k" * 32), WEIGHTS)
    server = transport.serve("127.0.0.1:0", service)
    channel = transport.connect(server.address)
    try:
        got = channel.request(Get(channel.new_request_id(), 1, "w", (0,), StridedSpan(0, 4096)), timeout=10)
        assert bytes(got.payload) == shard.tobytes()
        span = (StridedSpan(0, 4096),)
        assert isinstance(channel.request(Sums(channel.new_request_id(), 1, "w", span), timeout=10), SumsReply)
        current[0] = 2
        for req in (Get(channel.new_request_id(), 1, "w", (0,), span[0]), Sums(channel.new_request_id(), 1, "w", span)):
            with pytest.raises(RequestError) as info:
                channel.request(req, timeout=10)
            assert info.value.code is ev.ErrorCode.NOT_FOUND
    finally:
        channel.close()
        server.close()
