"""KV events on the wire vLLM uses, for processes that are not vLLM engines (store nodes).

KV-aware routers (llm-d's kv-indexer, Dynamo's router) subscribe to vLLM's KV event stream:
ZMQ PUB multipart ``[topic, 8-byte big-endian sequence, msgpack KVEventBatch]`` and a ROUTER
replay socket that answers ``[b"", 8-byte start sequence]`` with every buffered batch from
that sequence, ``[b"", topic, seq, payload]`` each, then ``[b"", b"", -1 (8 bytes), b""]``.
:class:`KVEventPublisher` speaks exactly that, and the structs below encode exactly as
``vllm.distributed.kv_events`` does (array-like batch, events as maps tagged by class name,
defaults omitted), so a subscriber decodes them with vLLM's own classes. pyzmq and msgspec
(the ``net`` extra) are imported when a publisher is built, not with this module's users.

Replay requests are network input: a request that is not ``[id, b"", 8 bytes]`` is dropped
(logged once per kind), a start sequence beyond the last batch gets only the end marker, and
the buffer is bounded (``buffer_steps`` batches).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tiersync.errors import UsageError, check_positive_int

if TYPE_CHECKING:
    import zmq

__all__ = ["END_SEQ", "KVEventPublisher", "KVEventsConfig", "all_cleared", "block_removed", "block_stored"]

log = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_SCHEMA: dict[str, Any] = {}


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """``endpoint``: PUB address to bind (``tcp://*:5557``); ``replay_endpoint``: ROUTER address
    to bind, or None; ``topic``: the first frame of every message; ``buffer_steps``: batches
    kept for replay; ``max_queue``: batches waiting to be sent before :meth:`publish` drops."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    max_queue: int = 100_000

    def __post_init__(self) -> None:
        for name in ("endpoint", "replay_endpoint"):
            v = getattr(self, name)
            if (v is not None or name == "endpoint") and (not isinstance(v, str) or "://" not in v):
                raise UsageError("must be a ZMQ address such as tcp://*:5557", argument=name, value=v)
        if not isinstance(self.topic, str):
            raise UsageError("must be a str", argument="topic", value=self.topic)
        check_positive_int(self.buffer_steps, "buffer_steps")
        check_positive_int(self.max_queue, "max_queue")


def _schema() -> dict[str, Any]:
    """vLLM's KVEventBatch / BlockStored / BlockRemoved / AllBlocksCleared as msgspec structs
    (same names, fields, order, defaults and struct options: the encoding is identical)."""
    if _SCHEMA:
        return _SCHEMA
    import msgspec

    Hash = bytes | int

    class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[Hash]
        parent_block_hash: Hash | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None
        locality: str | None = None
        ownership: str | None = None
        session_id: str | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[Hash]
        medium: str | None
        group_idx: int | None = None
        locality: str | None = None
        ownership: str | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]
        data_parallel_rank: int | None = None

    _SCHEMA.update(
        BlockStored=BlockStored,
        BlockRemoved=BlockRemoved,
        AllBlocksCleared=AllBlocksCleared,
        KVEventBatch=KVEventBatch,
        encode=msgspec.msgpack.Encoder().encode,
    )
    return _SCHEMA


def block_stored(
    hashes: list[bytes],
    medium: str,
    token_ids: list[int] | None = None,
    block_size: int = 0,
    parent: bytes | None = None,
) -> Any:
    return _schema()["BlockStored"](
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=list(token_ids or ()),
        block_size=block_size,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


def block_removed(hashes: list[bytes], medium: str) -> Any:
    return _schema()["BlockRemoved"](block_hashes=list(hashes), medium=medium)


def all_cleared() -> Any:
    return _schema()["AllBlocksCleared"]()


class KVEventPublisher:
    """Publishes event batches on a PUB socket and answers replays (see the module docstring).
    :meth:`publish` never blocks: a full queue drops the batch (counted in ``dropped``)."""

    def __init__(self, config: KVEventsConfig) -> None:
        import zmq

        if not isinstance(config, KVEventsConfig):
            raise UsageError("must be a KVEventsConfig", argument="config", got=type(config).__name__)
        self.config, self._zmq = config, zmq
        self._schema = _schema()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = self._ctx.socket(zmq.ROUTER) if config.replay_endpoint else None
        if self._replay is not None:  # a replay request is 3 small frames: refuse big ones at the socket
            self._replay.setsockopt(zmq.MAXMSGSIZE, 256)
        where: str | None
        argument, where = "endpoint", config.endpoint
        try:
            self.endpoint = _bind(self._pub, where)
            argument, where = "replay_endpoint", config.replay_endpoint
            self.replay_endpoint = _bind(self._replay, where) if self._replay and where else None
        except zmq.ZMQError as exc:
            self._ctx.destroy(linger=0)
            raise UsageError(f"cannot bind: {exc}", argument=argument, value=where) from None
        self._queue: queue.Queue[list[Any] | None] = queue.Queue(config.max_queue)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self.sent = self.dropped = self.bad_replays = 0
        self._progress = threading.Condition()
        self._queued = 0
        self._thread = threading.Thread(target=self._run, name="tiersync-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[Any]) -> None:
        """Queue one batch (a list of events from :func:`block_stored` etc.)."""
        if events:
            with self._progress:
                try:
                    self._queue.put_nowait(list(events))
                    self._queued += 1
                except queue.Full:
                    self.dropped += 1

    def flush(self, timeout: float) -> bool:
        """Wait until every batch queued so far is handled (sent, or logged as lost); False
        when ``timeout`` passed first."""
        with self._progress:
            return self._progress.wait_for(lambda: self.sent >= self._queued, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (up to ``timeout``), then close the sockets. Idempotent. The
        sending thread owns the sockets and closes them itself; one still busy after
        ``timeout`` keeps them (it exits after its current batch) rather than share them."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("kv events: the sender is still busy after %.1f s; it closes its sockets when done", timeout)
            return
        self._ctx.term()

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        """Send queued batches; answer replays only with the queue empty, so a replay asked
        after a batch was queued (a store node's COMMITTED) includes it. A batch or a replay
        that fails is logged and skipped: the thread keeps serving. It closes the sockets."""
        seq = 0
        try:
            while (events := self._next()) is not None:
                if events:
                    seq = self._send(seq, events)
                if self._replay is not None and self._queue.empty() and self._replay.poll(0):
                    try:
                        self._answer_replay()
                    except Exception as exc:  # noqa: BLE001 - a peer's request must not end the thread
                        log.warning("kv events: replay failed: %s", exc)
        finally:
            for sock in (self._pub, self._replay):
                if sock is not None:
                    sock.close(linger=1000)

    def _next(self) -> list[Any] | None:
        try:
            return self._queue.get(timeout=0.02)
        except queue.Empty:
            return []

    def _send(self, seq: int, events: list[Any]) -> int:
        try:
            payload = self._schema["encode"](self._schema["KVEventBatch"](ts=time.time(), events=events))
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        except Exception as exc:  # noqa: BLE001 - one bad batch is lost, not the stream
            log.warning("kv events: batch %d not sent: %s", seq, exc)
            payload = None
        if payload is not None:
            self._buffer.append((seq, payload))
            seq += 1
        with self._progress:
            self.sent += 1
            self._progress.notify_all()
        return seq

    def _answer_replay(self) -> None:
        replay = self._replay
        assert replay is not None  # _run answers replays only with a replay socket
        frames = replay.recv_multipart()
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            self.bad_replays += 1
            if self.bad_replays == 1:
                log.warning("kv events: malformed replay request (%d frames) dropped", len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", b"", END_SEQ, b""))


def _bind(sock: zmq.Socket[bytes], endpoint: str) -> str:
    """Bind ``endpoint``; with port 0 (``tcp://127.0.0.1:0``) the address actually bound."""
    import zmq

    if endpoint.endswith(":0"):
        sock.bind_to_random_port(endpoint[:-2])
    else:
        sock.bind(endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)
