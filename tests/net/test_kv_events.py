"""The KV event wire (vLLM's): PUB stream, replay from a sequence, hostile replay requests, bounds.

Decoding with vLLM's own classes, and a store node's stream across a subscriber restart, are in
``tests/integrations/test_vllm_kv_events.py`` (they need the vLLM venv).
"""

from __future__ import annotations

import socket

import pytest

zmq = pytest.importorskip("zmq", reason="pyzmq (the net extra) is not installed")
msgspec = pytest.importorskip("msgspec", reason="msgspec (the net extra) is not installed")

from tiersync.errors import UsageError  # noqa: E402
from tiersync.net.kv_events import (  # noqa: E402
    END_SEQ,
    KVEventPublisher,
    KVEventsConfig,
    all_cleared,
    block_removed,
    block_stored,
)

KEYS = [bytes([i]) * 16 for i in range(4)]


@pytest.fixture
def publisher():
    with KVEventPublisher(
        KVEventsConfig("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", topic="kv@n@m", buffer_steps=3)
    ) as pub:
        yield pub


def _replay(pub: KVEventPublisher, frames: list[bytes]) -> list[list[bytes]]:
    """Send ``frames`` to the replay socket; every answer up to the end marker."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(pub.replay_endpoint)
        sock.send_multipart(frames)
        out = []
        while sock.poll(10_000):
            msg = sock.recv_multipart()
            if msg[2] == END_SEQ:
                return out
            out.append(msg)
        raise AssertionError("no end marker within 10 s")
    finally:
        ctx.destroy(linger=0)


def _publish_and_wait(pub: KVEventPublisher, batches: list[list]) -> None:
    for b in batches:
        pub.publish(b)
    assert pub.flush(10)


def _decode(payload: bytes) -> list:
    """A batch decoded as plain msgpack: [ts, [event maps], rank] (vLLM's array-like batch)."""
    ts, events, *_ = msgspec.msgpack.decode(payload)
    assert isinstance(ts, float)
    return events


def test_replay_from_a_sequence_returns_that_batch_and_the_later_ones(publisher):
    _publish_and_wait(publisher, [[all_cleared()], [block_stored(KEYS[:2], "CPU")], [block_removed(KEYS[:1], "CPU")]])
    got = _replay(publisher, [b"", (1).to_bytes(8, "big")])
    assert [(m[1], int.from_bytes(m[2], "big")) for m in got] == [(b"kv@n@m", 1), (b"kv@n@m", 2)]
    stored, removed = _decode(got[0][3])[0], _decode(got[1][3])[0]
    assert stored["type"] == "BlockStored" and stored["block_hashes"] == KEYS[:2] and stored["medium"] == "CPU"
    assert stored["token_ids"] == [] and stored["parent_block_hash"] is None
    assert removed == {"type": "BlockRemoved", "block_hashes": KEYS[:1], "medium": "CPU"}  # defaults omitted
    assert _replay(publisher, [b"", (99).to_bytes(8, "big")]) == []  # beyond the last: only the end marker


def test_replay_buffer_is_bounded(publisher):
    _publish_and_wait(publisher, [[block_stored([k], "CPU")] for k in KEYS])  # 4 batches, 3 kept
    assert [int.from_bytes(m[2], "big") for m in _replay(publisher, [b"", bytes(8)])] == [1, 2, 3]


def test_malformed_replay_requests_are_dropped_and_the_socket_keeps_answering(publisher):
    _publish_and_wait(publisher, [[all_cleared()]])
    ctx = zmq.Context()
    try:
        bad = ctx.socket(zmq.DEALER)
        bad.connect(publisher.replay_endpoint)
        for frames in ([b"", b"\x00" * 3], [b"x", bytes(8)], [b"", bytes(8), b"extra"]):
            bad.send_multipart(frames)
        assert not bad.poll(300)  # no answer to any of them
    finally:
        ctx.destroy(linger=0)
    assert len(_replay(publisher, [b"", bytes(8)])) == 1
    assert publisher.bad_replays == 3
    ctx = zmq.Context()
    try:  # a huge frame is refused by the socket itself (the peer is dropped), nothing is buffered
        big = ctx.socket(zmq.DEALER)
        big.connect(publisher.replay_endpoint)
        big.send_multipart([b"", b"x" * (8 << 20)])
        assert not big.poll(300)
    finally:
        ctx.destroy(linger=0)
    assert len(_replay(publisher, [b"", bytes(8)])) == 1 and publisher.bad_replays == 3


def test_live_subscriber_sees_topic_sequence_and_payload(publisher):
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.connect(publisher.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@n@m")
        for _ in range(200):  # PUB drops what is sent before the subscription arrives: retry
            publisher.publish([all_cleared()])
            if sub.poll(50):
                break
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv@n@m" and len(seq) == 8 and _decode(payload) == [{"type": "AllBlocksCleared"}]
    finally:
        ctx.destroy(linger=0)


def test_config_and_bind_errors_name_the_argument():
    with pytest.raises(UsageError) as ei:
        KVEventsConfig("127.0.0.1:5557")
    assert ei.value.argument == "endpoint"
    with pytest.raises(UsageError) as ei:
        KVEventsConfig("tcp://*:1", replay_endpoint="nowhere")
    assert ei.value.argument == "replay_endpoint"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(UsageError) as ei:
            KVEventPublisher(KVEventsConfig(f"tcp://127.0.0.1:{port}"))
        assert ei.value.argument == "endpoint"
        with pytest.raises(UsageError) as ei:
            KVEventPublisher(KVEventsConfig("tcp://127.0.0.1:0", replay_endpoint=f"tcp://127.0.0.1:{port}"))
        assert ei.value.argument == "replay_endpoint"
