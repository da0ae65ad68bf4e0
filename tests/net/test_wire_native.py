"""The native receive path (``tiersync.net._wire``) against real sockets.

Invariant: a frame the native receiver accepts is exactly what the sans-IO parser would have
accepted, and anything else (a stale checksum, another size, an ERROR, a frame cut into tiny
TCP segments) ends as the parser decides: a verified DATA, a refused frame, or an error answer.
A server whose handler misbehaves on purpose stands in for a hostile peer.
"""

from __future__ import annotations

import os
import random
import socket
import threading

import pytest
import xxhash

from tiersync.net import events as ev
from tiersync.net import store_ops as so
from tiersync.net.errors import ProtocolError, ProtocolFault, RequestError
from tiersync.net.frames import PayloadChecksum
from tiersync.net.source import MemoryBlockSource
from tiersync.net.tcp import Route, TcpConfig, TcpTransport

_wire = pytest.importorskip("tiersync.net._wire", reason="the native receiver is not built here")

GOOD = [bytes([i]) * 16 for i in range(12)]
STALE, SHORT, REFUSE = b"\xa1" * 16, b"\xa2" * 16, b"\xa3" * 16
SIZE = 300_000  # more than one 256 KiB piece: the payload is summed in several parts


class HostileSource(MemoryBlockSource):
    """Serves GOOD blocks honestly; STALE with a wrong checksum in the header, SHORT with fewer
    bytes than the lease said, REFUSE with an ERROR answer."""

    def handle(self, session, req):
        if isinstance(req, so.PullMany):  # grouped small pulls: hostile when any item is
            keys = [k for k, _, _ in req.items]
            views = [self._blocks[k] for k in keys]
            if REFUSE in keys:
                return [ev.Error(req.request_id, ev.ErrorCode.INTERNAL, "refused on purpose")]
            if SHORT in keys:
                views[keys.index(SHORT)] = views[keys.index(SHORT)][:-1]
            return [ev.Data(req.request_id, views, (PayloadChecksum.TSUM64, 12345) if STALE in keys else None)]
        if not isinstance(req, so.Pull):
            return super().handle(session, req)
        if req.key == STALE:
            return [ev.Data(req.request_id, self._blocks[req.key], (PayloadChecksum.TSUM64, 12345))]
        if req.key == SHORT:
            return [ev.Data(req.request_id, self._blocks[req.key][:-1])]
        if req.key == REFUSE:
            return [ev.Error(req.request_id, ev.ErrorCode.INTERNAL, "refused on purpose")]
        return super().handle(session, req)


@pytest.fixture()
def served():
    blocks = {k: os.urandom(SIZE) for k in (*GOOD, STALE, SHORT, REFUSE)}
    transport = TcpTransport(TcpConfig(sndbuf=128 << 10, route=Route.TCP))  # under a frame: each arrives in parts
    server = transport.serve("127.0.0.1:0", HostileSource(blocks))
    channel = transport.connect(server.address)
    try:
        assert channel.payload_checksum is PayloadChecksum.TSUM64  # the native path is the one used
        lease = channel.request(so.ReadLease(channel.new_request_id(), tuple(blocks), ttl_s=60)).lease_id
        yield channel, lease, blocks
    finally:
        channel.close()
        server.close()


def _dests(keys, size=SIZE):
    return [(k, 0, memoryview(bytearray(size))) for k in keys]


@pytest.mark.parametrize("window", [1, 2, 8, 24])
def test_pipelined_windows_land_every_block_exactly(served, window):
    channel, lease, blocks = served
    items = _dests(GOOD * 3)
    channel.pull_many(lease, items, window=window)
    assert all(bytes(d) == blocks[k] for k, _, d in items)


def test_a_stale_checksum_is_refused_after_the_good_frames_landed(served):
    channel, lease, blocks = served
    items = _dests([GOOD[0], GOOD[1], STALE, GOOD[2]])
    with pytest.raises(ProtocolError) as exc:
        channel.pull_many(lease, items, window=4)
    assert exc.value.fault is ProtocolFault.BAD_CHECKSUM
    assert bytes(items[0][2]) == blocks[GOOD[0]] and bytes(items[1][2]) == blocks[GOOD[1]]
    assert channel.closed  # a peer that sent corrupt bytes is not talked to again


def test_a_frame_of_another_size_is_refused(served):
    channel, lease, _ = served
    with pytest.raises(ProtocolError):
        channel.pull_many(lease, _dests([GOOD[0], SHORT, GOOD[1]]), window=4)
    assert channel.closed


def test_an_error_answer_in_a_window_is_a_request_error(served):
    _channel, _lease, blocks = served
    from tiersync.net.pull_plan import GROUP_BYTES

    big = {k: os.urandom(GROUP_BYTES) for k in (GOOD[3], GOOD[4])}  # not grouped: one PULL, one answer each
    source = HostileSource({**big, REFUSE: blocks[REFUSE]})
    server = TcpTransport(TcpConfig(route=Route.TCP)).serve("127.0.0.1:0", source)
    try:
        ch = TcpTransport(TcpConfig(route=Route.TCP)).connect(server.address)
        lid = ch.request(so.ReadLease(ch.new_request_id(), (GOOD[3], REFUSE, GOOD[4]), ttl_s=60)).lease_id
        items = [
            (GOOD[3], 0, memoryview(bytearray(GROUP_BYTES))),
            (REFUSE, 0, memoryview(bytearray(SIZE))),
            (GOOD[4], 0, memoryview(bytearray(GROUP_BYTES))),
        ]
        with pytest.raises(RequestError, match="refused on purpose"):
            ch.pull_many(lid, items, window=4)
        assert bytes(items[0][2]) == big[GOOD[3]] and ch.closed
    finally:
        server.close()


def test_a_refused_range_in_a_grouped_pull_refuses_the_group(served):
    channel, lease, _blocks = served
    items = _dests([GOOD[3], REFUSE, GOOD[4]])  # small ranges travel as one PULL_MANY
    with pytest.raises(RequestError, match="refused on purpose"):
        channel.pull_many(lease, items, window=4)
    assert channel.closed


def test_a_frame_trickled_a_few_bytes_at_a_time_still_verifies():
    """Every read returns a fragment (header and payload cut into 7-byte writes)."""
    from _proto_helpers import deliver, ready_pair
    from tiersync.net.socket_io import Deadline, FramedSocket

    block = os.urandom(5000)
    client, server = ready_pair(PayloadChecksum.TSUM64)
    pulls = [so.Pull(rid, 7, GOOD[0], 0, len(block)) for rid in (1, 2)]
    for p in pulls:
        deliver(client, server, p)
    wire = b"".join(bytes(b) for p in pulls for b in server.send(ev.Data(p.request_id, block)))
    dests = [memoryview(bytearray(len(block))) for _ in pulls]
    for p, d in zip(pulls, dests):
        client.expect_payload_into(p.request_id, d)
    a, b = socket.socketpair()
    writer = threading.Thread(target=lambda: [b.sendall(wire[i : i + 7]) for i in range(0, len(wire), 7)])
    writer.start()
    try:
        framed = FramedSocket(a, client, "trickle", TcpConfig())
        got = []
        while len(got) < 2:
            got += framed.read_data([1, 2][len(got) :], Deadline(30, "trickle"))
        assert [e.request_id for e in got] == [1, 2] and all(isinstance(e, ev.Data) for e in got)
        assert all(bytes(d) == block for d in dests)
        assert all(e.payload_sum[0] is PayloadChecksum.TSUM64 for e in got)
    finally:
        writer.join()
        a.close()
        b.close()


def test_recv_many_refuses_bad_arguments():
    a, b = socket.socketpair()
    try:
        with pytest.raises(ValueError):
            _wire.recv_many(a.fileno(), bytearray(10), [bytearray(8)], [1], 1 << 20, 0, 0.0)
        with pytest.raises(ValueError):
            _wire.recv_many(a.fileno(), bytearray(64), [bytearray(8)], [1, 2], 1 << 20, 0, 0.0)
        with pytest.raises(ValueError):
            _wire.recv_many(a.fileno(), bytearray(64), [], [], 1 << 20, 0, 0.0)
        with pytest.raises(BufferError):
            _wire.recv_many(a.fileno(), bytearray(64), [b"read-only"], [1], 1 << 20, 0, 0.0)
    finally:
        a.close()
        b.close()


def test_header_checksum_matches_xxhash():
    rng = random.Random(7)
    for _ in range(300):
        data = bytes(rng.getrandbits(8) for _ in range(56))
        assert _wire._xxh3_56(data) == xxhash.xxh3_64_intdigest(data)


def test_native_constants_match_the_frame_format():
    """A protocol bump that forgets the C side would silently turn the fast path off."""
    from tiersync.net.frames import PROTOCOL_VERSION, Op

    assert (PROTOCOL_VERSION, int(Op.DATA), int(PayloadChecksum.TSUM64)) == (
        _wire.VERSION,
        _wire.OP_DATA,
        _wire.ALGO_TSUM64,
    )


@pytest.mark.parametrize("vectored", [False, True])
def test_recv_many_verifies_what_the_parser_would(vectored):
    """Frames the sans-IO side encodes are taken and verified by the native receiver itself
    (``done`` counts them), into one buffer or scattered into several."""
    from _proto_helpers import deliver, ready_pair
    from tiersync.net.socket_io import EMPTY_META_CHECKSUM

    blocks = [os.urandom(SIZE), os.urandom(3 * SIZE + 5)]
    client, server = ready_pair(PayloadChecksum.TSUM64)
    pulls = [so.Pull(rid, 7, GOOD[0], 0, len(b)) for rid, b in zip((1, 2), blocks)]
    for p in pulls:
        deliver(client, server, p)
    wire = b"".join(bytes(x) for p, b in zip(pulls, blocks) for x in server.send(ev.Data(p.request_id, b)))
    if vectored:  # uneven pieces, one of them empty
        cuts = [[bytearray(1000), bytearray(0), bytearray(len(b) - 1000)] for b in blocks]
        dests = [[memoryview(c) for c in cut] for cut in cuts]
    else:
        cuts = [[bytearray(len(b))] for b in blocks]
        dests = [memoryview(c[0]) for c in cuts]
    a, b = socket.socketpair()
    writer = threading.Thread(target=b.sendall, args=(wire,))
    writer.start()
    try:
        done, sums, _, err = _wire.recv_many(
            a.fileno(), bytearray(64), dests, [1, 2], 64 << 20, EMPTY_META_CHECKSUM, 0.0
        )
    finally:
        writer.join()
        a.close()
        b.close()
    assert (done, err) == (2, 0)
    assert [b"".join(bytes(c) for c in cut) for cut in cuts] == blocks
    from tiersync.net.frames import payload_checksum

    assert list(sums) == [payload_checksum(PayloadChecksum.TSUM64, blk) for blk in blocks]


class _Alarm(Exception):
    pass


def _raise_alarm(signum, frame):
    raise _Alarm


def test_a_signal_during_a_blocked_receive_runs_its_handler_at_once():
    """Ctrl-C (an interval timer whose handler raises) ends a receive waiting for a silent peer
    at once, not when the socket's timeout fires (each retry inside restarted that timeout)."""
    import signal
    import struct
    import time

    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("@ll", 8, 0))  # the old code's end
    old = signal.signal(signal.SIGALRM, _raise_alarm)
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    t0 = time.monotonic()
    try:
        with pytest.raises(_Alarm):
            _wire.recv_many(a.fileno(), bytearray(64), [bytearray(4096)], [1], 1 << 20, 0, 0.0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        a.close()
        b.close()
    assert time.monotonic() - t0 < 5


def test_a_peer_trickling_a_payload_cannot_hold_the_reader_past_its_deadline():
    """A valid DATA header, then one byte every 0.1 s: each read returns before the socket's
    receive timeout, so without the call's own deadline the receiver would wait for the whole
    payload (an hour here). It stops starting reads at timeout_s and hands what landed over."""
    import struct
    import time

    from _proto_helpers import deliver, ready_pair
    from tiersync.net.socket_io import EMPTY_META_CHECKSUM

    payload = os.urandom(64 << 10)
    client, server = ready_pair(PayloadChecksum.TSUM64)
    pull = so.Pull(1, 7, GOOD[0], 0, len(payload))
    deliver(client, server, pull)
    wire = b"".join(bytes(x) for x in server.send(ev.Data(1, payload)))
    with socket.create_server(("127.0.0.1", 0)) as listener:  # TCP: each read waits its own timeout
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("@ll", 0, 500_000))
    stop = threading.Event()

    def trickle() -> None:
        b.sendall(wire[:100])
        for i in range(100, len(wire)):
            if stop.wait(0.1):
                return
            b.sendall(wire[i : i + 1])

    writer = threading.Thread(target=trickle, daemon=True)
    writer.start()
    t0 = time.monotonic()
    try:
        done, _, n, err = _wire.recv_many(
            a.fileno(), bytearray(64), [bytearray(len(payload))], [1], 1 << 20, EMPTY_META_CHECKSUM, 1.0
        )
        elapsed = time.monotonic() - t0
    finally:
        stop.set()
        writer.join(5)
        a.close()
        b.close()
    assert (done, err) == (0, 0) and 100 <= n < len(wire)  # what landed goes to the parser
    assert elapsed < 10, elapsed  # about 1 s (the deadline plus one read's timeout at most)


def test_no_next_frame_is_begun_past_the_deadline():
    """Two DATA answers expected; the first arrives whole but after the call's deadline: it is
    taken, and the second is not waited for (n 0, ETIMEDOUT; not the socket's timeout, EAGAIN)."""
    import errno
    import struct

    from _proto_helpers import deliver, ready_pair
    from tiersync.net.socket_io import EMPTY_META_CHECKSUM

    payload = os.urandom(4096)
    client, server = ready_pair(PayloadChecksum.TSUM64)
    for rid in (1, 2):
        deliver(client, server, so.Pull(rid, 7, GOOD[0], 0, len(payload)))
    first = b"".join(bytes(x) for x in server.send(ev.Data(1, payload)))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("@ll", 2, 0))
    late = threading.Timer(0.4, b.sendall, args=(first,))
    late.start()
    try:
        dests = [bytearray(len(payload)), bytearray(len(payload))]
        done, _, n, err = _wire.recv_many(a.fileno(), bytearray(64), dests, [1, 2], 1 << 20, EMPTY_META_CHECKSUM, 0.2)
    finally:
        late.join()
        a.close()
        b.close()
    assert (done, n, err) == (1, 0, errno.ETIMEDOUT) and dests[0] == payload
