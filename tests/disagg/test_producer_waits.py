"""tiersync.disagg.producer: readers asking for layers not ready yet hold none of the producer's workers."""

from __future__ import annotations

import numpy as np

from _wait import until
from tiersync.disagg import DisaggConfig, KVOrder, KVProducer, PagedKVLayout, RequestState
from tiersync.disagg.messages import ReadRequest
from tiersync.disagg.ops import KV, KvLayer, KvNext, KvOpen, KvOpened
from tiersync.net.errors import RequestError
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
TOKEN = b"producer-waits-test-token-0123"


def _reader(producer: KVProducer, request_id: str):
    channel = TcpTransport(TcpConfig(token=TOKEN), KV).connect(producer.address)
    read = ReadRequest(request_id, 0, 0, LAYOUT, (1,), (0,), 4, LAYOUT)
    assert isinstance(channel.request(KvOpen(channel.new_request_id(), read), timeout=5), KvOpened)
    return channel


def test_readers_waiting_for_layers_leave_the_workers_to_a_reader_whose_layers_are_ready():
    """Two workers; four readers each ask for layer 0 of a request whose layers are not ready.
    A fifth reader, of a request whose layers are, opens it and is told both layers at once;
    then the four are told theirs as each becomes ready. A waiting KV_NEXT used to hold a
    worker until its layer came (up to timeout_s), so the fifth waited for the four."""
    src = np.arange(LAYOUT.layer_nbytes, dtype=np.uint8)
    config = DisaggConfig(token=TOKEN, timeout_s=60, workers=2)
    with KVProducer(LAYOUT, 0, config) as producer:
        for i in range(4):
            producer.register(f"slow-{i}", [0], 4, [src, src])
        producer.register("ready", [0], 4, [src, src])
        producer.layer_ready("ready", 0)
        producer.layer_ready("ready", 1)
        waiting = [_reader(producer, f"slow-{i}") for i in range(4)]
        asked = []
        for ch in waiting:
            asked.append(KvNext(ch.new_request_id(), 0))
            ch.send(asked[-1])
        assert until(lambda: len(producer._server._responder.parked) == 4)  # none of them on a worker
        ready = _reader(producer, "ready")
        assert [ready.request(KvNext(ready.new_request_id(), n), timeout=5).layer for n in range(2)] == [0, 1]
        ready.close()
        for i, (ch, ask) in enumerate(zip(waiting, asked)):
            producer.layer_ready(f"slow-{i}", 1)
            assert ch.next_answer(ask.request_id, timeout=10) == KvLayer(ask.request_id, 1)
            ch.close()


def test_a_reader_waiting_for_a_layer_of_an_aborted_request_is_told_at_once():
    src = np.arange(LAYOUT.layer_nbytes, dtype=np.uint8)
    with KVProducer(LAYOUT, 0, DisaggConfig(token=TOKEN, timeout_s=60)) as producer:
        producer.register("gone", [0], 4, [src, src])
        ch = _reader(producer, "gone")
        ask = KvNext(ch.new_request_id(), 0)
        ch.send(ask)
        assert until(lambda: len(producer._server._responder.parked) == 1)
        assert producer.abort("gone")
        try:  # the abort closes the reader's session; an answer may or may not make it out first
            answer = ch.next_answer(ask.request_id, timeout=5)
            raise AssertionError(f"an aborted request's layer was told: {answer}")
        except RequestError as exc:
            assert "aborted" in str(exc)
        except Exception as exc:  # noqa: BLE001 - the session ended: PeerClosedError or a reset
            assert "closed" in str(exc) or "reset" in str(exc), exc
        finally:
            ch.close()
        assert until(lambda: len(producer._server._responder.parked) == 0)


def test_a_reader_that_hangs_up_while_waiting_for_a_layer_fails_the_request_at_once():
    """Not at the request's deadline (60 s): the prefill engine frees its blocks now."""
    src = np.arange(LAYOUT.layer_nbytes, dtype=np.uint8)
    with KVProducer(LAYOUT, 0, DisaggConfig(token=TOKEN, timeout_s=60)) as producer:
        producer.register("left", [0], 4, [src, src])
        ch = _reader(producer, "left")
        ch.send(KvNext(ch.new_request_id(), 0))
        assert until(lambda: len(producer._server._responder.parked) == 1)
        ch.close()
        assert until(lambda: producer.state("left") is RequestState.FAILED)
        assert producer.poll().failed_sending == {"left"}
