"""weights/serving.py: a GET of bytes not written yet parks its session (no server worker) until
they are, for at most the service's timeout; over real connections to a real server."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from _wait import until
from tiersync.errors import RemoteError
from tiersync.net.config import ByReference, TcpConfig
from tiersync.net.tcp import TcpTransport
from tiersync.weights.config import TransportKind
from tiersync.weights.fetch import Job, Source, TcpPool
from tiersync.weights.ops import WEIGHTS
from tiersync.weights.publish_buffer import PublishBuffer
from tiersync.weights.serving import SpanService
from tiersync.weights.spans import StridedSpan

TOKEN = b"s" * 32
SIZE = 1 << 16


class _Counted:
    """A trainer shard's buffer as the provider, counting the GETs it answered 'not yet'."""

    def __init__(self) -> None:
        self.buf = PublishBuffer(threading.Condition(), None, {"early": 0, "late": 1}, [0, SIZE], [SIZE] * 2, 2 * SIZE)
        self.buf.begin(1, set(), 5)
        self.waits = 0

    def __call__(self, *args):
        got = self.buf.provide(*args)
        self.waits += not isinstance(got, tuple)
        return got


def _get(address: str, tensor: str, timeout: float) -> np.ndarray:
    span = StridedSpan(0, SIZE)
    job = Job(tensor, 0, (0,), 0, span, (Source(TransportKind.TCP, span, address=address),))
    pool, dst = TcpPool(1, TcpConfig(token=TOKEN), timeout), np.zeros(SIZE, np.uint8)
    try:
        pool.get_many(address, 1, [job], {tensor: dst}, 1, lambda _: None, timeout)
    finally:
        pool.close()
    return dst


def test_gets_waiting_for_their_bytes_hold_no_worker_and_are_answered_once_written():
    """Two server workers, three GETs of a tensor not written yet: a GET of a written tensor is
    answered meanwhile (when a waiting GET held its worker, it timed out), and the three get
    their bytes, byte-exact, once the tensor is written."""
    provider, rng = _Counted(), np.random.default_rng(3)
    early, late = rng.integers(0, 256, SIZE, dtype=np.uint8), rng.integers(0, 256, SIZE, dtype=np.uint8)
    server = TcpTransport(TcpConfig(token=TOKEN, workers=2), WEIGHTS).serve("127.0.0.1:0", SpanService(provider, 60.0))
    got: dict[int, np.ndarray] = {}
    threads = [
        threading.Thread(target=lambda i=i: got.update({i: _get(server.address, "late", 60.0)})) for i in range(3)
    ]
    try:
        for t in threads:
            t.start()
        assert until(lambda: provider.waits >= 3)  # all three asked, none answered
        provider.buf.write(0, early)
        assert np.array_equal(_get(server.address, "early", 5.0), early) and not got
        provider.buf.write(1, late)
        for t in threads:
            t.join(30)
        assert sorted(got) == [0, 1, 2] and all(np.array_equal(v, late) for v in got.values())
    finally:
        server.close()


def test_a_get_whose_bytes_never_come_is_refused_at_the_services_timeout_and_a_later_one_served():
    provider = _Counted()
    server = TcpTransport(TcpConfig(token=TOKEN), WEIGHTS).serve("127.0.0.1:0", SpanService(provider, 0.5))
    try:
        with pytest.raises(RemoteError, match="not there in time"):
            _get(server.address, "late", 10.0)
        provider.buf.write(1, np.full(SIZE, 9, np.uint8))
        assert np.array_equal(_get(server.address, "late", 5.0), np.full(SIZE, 9, np.uint8))
    finally:
        server.close()


BIG = 48 << 20  # more than the server's send buffer and a small receive buffer hold


class _Lent:
    """A provider of two written tensors that counts the GETs it lent bytes to and their releases."""

    def __init__(self) -> None:
        rng = np.random.default_rng(5)
        self.arrays = {"big": rng.integers(0, 256, BIG, dtype=np.uint8), "small": np.arange(SIZE, dtype=np.uint8)}
        self.lent = self.released = 0
        self.lock = threading.Lock()

    def __call__(self, version, tensor, key, span):
        with self.lock:
            self.lent += 1
        return self.arrays[tensor], self._release

    def _release(self) -> None:
        with self.lock:
            self.released += 1


def _stalled(address: str) -> tuple[object, int]:
    """A sampler that GETs "big" and "small" behind it, and reads nothing yet."""
    from tiersync.weights.ops import Get

    ch = TcpTransport(TcpConfig(token=TOKEN, rcvbuf=64 << 10), WEIGHTS).connect(address)
    big, small = ch.new_request_id(), ch.new_request_id()
    ch.send_many([Get(big, 1, "big", (0,), StridedSpan(0, BIG)), Get(small, 1, "small", (0,), StridedSpan(0, SIZE))])
    return ch, big


def _bytes(answer) -> bytes:
    parts = answer.payload if isinstance(answer.payload, list) else [answer.payload]
    return b"".join(map(bytes, parts))


@pytest.mark.parametrize("pinned", [False, True], ids=["copied", "pinned-by-reference"])
def test_samplers_that_do_not_read_their_data_hold_no_worker_and_every_lent_buffer_is_released(pinned):
    """Two server workers, three samplers that GET 48 MiB and read nothing: a streamed DATA the
    peer does not take within a second waits for room without its worker (it held the worker
    for op_timeout_s before, and another sampler's GET timed out). A sampler that reads late
    gets every byte, then the GET it sent behind; one that hangs up, and one that never reads
    (ended at op_timeout_s, 8 s here), have their GETs' buffers released all the same."""
    provider = _Lent()
    mode = ByReference.ALWAYS if pinned else ByReference.AUTO  # loopback: by reference only when forced
    config = TcpConfig(token=TOKEN, workers=2, op_timeout_s=8.0, by_reference=mode)
    server = TcpTransport(config, WEIGHTS).serve("127.0.0.1:0", SpanService(provider, 60.0, pinned=pinned))
    samplers = [_stalled(server.address) for _ in range(3)]
    try:
        assert np.array_equal(_get(server.address, "small", 5.0), provider.arrays["small"])
        late, big = samplers[0]
        assert _bytes(late.next_answer(big, timeout=30.0)) == provider.arrays["big"].tobytes()
        assert _bytes(late.next_answer(big + 1, timeout=10.0)) == provider.arrays["small"].tobytes()
        samplers[1][0].close()  # hangs up; samplers[2] reads nothing, for good
        assert until(lambda: server.connections == 1, 15.0)  # the late reader's only
        assert until(lambda: provider.released == provider.lent, 10.0) and provider.lent == 5
    finally:
        for ch, _ in samplers:
            ch.close()
        server.close()


def test_a_get_woken_again_and_again_without_its_bytes_is_refused_at_its_first_parks_deadline():
    """The provider's watch wakes the GET every 50 ms and the bytes are never there (parts of
    other tensors written): each wake asks the service again, which parks again, and the GET is
    refused "not there in time" at the service's timeout from its first park, not pushed back
    by every wake."""
    import time

    asked: list[int] = []

    def provider(version, tensor, key, span):
        asked.append(1)
        return lambda wake: threading.Timer(0.05, wake).start()

    server = TcpTransport(TcpConfig(token=TOKEN), WEIGHTS).serve("127.0.0.1:0", SpanService(provider, 1.0))
    try:
        began = time.monotonic()
        with pytest.raises(RemoteError, match="not there in time"):
            _get(server.address, "any", 20.0)
        assert time.monotonic() - began >= 0.9 and len(asked) >= 5
    finally:
        server.close()


def test_a_relay_whose_chunk_lands_again_serves_the_new_bytes_with_their_own_checksum():
    """A relaying sampler served a chunk, then found it differed from the trainer's (a hostile
    relay upstream) and landed it again from the trainer, in the same span: the next GET gets
    the new bytes, checked by the wire. With the checksum of the first bytes kept per (version,
    span), every later GET of that chunk failed BAD_CHECKSUM and its readers dropped the relay."""
    from tiersync.weights.relay_chunks import RelayChunks

    rng, span = np.random.default_rng(5), StridedSpan(0, SIZE)
    buf, relay = rng.integers(0, 256, SIZE, dtype=np.uint8), RelayChunks()
    relay.begin(1, {"w": buf})
    job = Job("w", 0, (0,), 0, span, (Source(TransportKind.TCP, span, address="127.0.0.1:1"),))
    relay.landed([job])
    server = TcpTransport(TcpConfig(token=TOKEN), WEIGHTS).serve("127.0.0.1:0", SpanService(relay.provide, 5.0))
    try:
        assert np.array_equal(_get(server.address, "w", 10.0), buf)
        buf[:] = rng.integers(0, 256, SIZE, dtype=np.uint8)  # landed again from the trainer
        relay.landed([job])
        assert np.array_equal(_get(server.address, "w", 10.0), buf)
    finally:
        server.close()


def test_gathered_copies_alive_at_once_are_capped_and_a_get_past_the_cap_waits_for_room():
    """Answers of strided spans of many small rows are gathered copies, held until written: a
    sampler that GETs one and reads nothing keeps its 16 MiB. With room for one copy, another
    sampler's GET of another such span waits (it was copied at once: many such peers held
    gigabytes) and gets its bytes, byte-exact, once the first hangs up and its copy is freed."""
    from tiersync.weights.ops import Get

    rows, stride = 16384, 2048  # 1 KiB rows every 2 KiB: 16 MiB gathered per span
    shard = np.random.default_rng(9).integers(0, 256, rows * stride + 1024, dtype=np.uint8)
    spans = [StridedSpan(o, 1024, (rows,), (stride,)) for o in (0, 1024)]
    lent = []

    def provider(version, tensor, key, span):
        lent.append(1)
        return shard, lent.pop

    server = TcpTransport(TcpConfig(token=TOKEN), WEIGHTS).serve(
        "127.0.0.1:0", SpanService(provider, 30.0, gather_bytes=rows * 1024)
    )
    hog = TcpTransport(TcpConfig(token=TOKEN, rcvbuf=64 << 10), WEIGHTS).connect(server.address)
    try:
        hog.send_many([Get(hog.new_request_id(), 1, "w", (0,), spans[0])])  # and reads nothing
        got, done = np.zeros(rows * 1024, np.uint8), threading.Event()
        job = Job("w", 0, (1,), 0, StridedSpan(0, rows * 1024), (Source(TransportKind.TCP, spans[1], address=""),))
        pool = TcpPool(1, TcpConfig(token=TOKEN), 30.0)
        reader = threading.Thread(
            target=lambda: (pool.get_many(server.address, 1, [job], {"w": got}, 1, lambda _: None, 30.0), done.set())
        )
        reader.start()
        assert not done.wait(2.0)  # waits for room while the hog's copy is alive
        hog.close()
        assert done.wait(20.0)
        assert np.array_equal(got, shard[1024 : 1024 + rows * stride].reshape(rows, stride)[:, :1024].reshape(-1))
        assert until(lambda: not lent, 10.0)  # every lent shard released
        reader.join(5)
        pool.close()
    finally:
        hog.close()
        server.close()
