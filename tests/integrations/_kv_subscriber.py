"""A KV-event subscriber as a router runs one: vLLM's own event classes decode the stream.

Run with the vLLM venv's python: ``_kv_subscriber.py PUB_ENDPOINT REPLAY_ENDPOINT TOPIC [FROM]``.
Prints "ready", then one JSON line per batch received live ({"seq", "events"}); when stdin
closes it asks the replay socket for every batch from sequence FROM (0), prints those as
{"replayed": seq, "events"} lines and "end". Events are printed as vLLM decoded them
(class name, block hashes as hex or int, parent, token ids, block size, medium).
"""

from __future__ import annotations

import json
import sys
import threading

import msgspec
import zmq
from vllm.distributed.kv_events import KVEventBatch

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _hash(h):
    return h.hex() if isinstance(h, bytes) else h


def _event(e) -> dict:
    out = {
        "type": type(e).__name__,
        "block_hashes": [_hash(h) for h in getattr(e, "block_hashes", [])],
        "medium": getattr(e, "medium", None),
    }
    if type(e).__name__ == "BlockStored":
        out.update(parent=_hash(e.parent_block_hash), token_ids=list(e.token_ids), block_size=e.block_size)
    return out


def main() -> None:
    pub, replay, topic = sys.argv[1:4]
    start = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(pub)
    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    decode = msgspec.msgpack.Decoder(KVEventBatch).decode
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    print("ready", flush=True)
    while not done.is_set():
        if sub.poll(100):
            _, seq, payload = sub.recv_multipart()
            batch = decode(payload)
            print(
                json.dumps({"seq": int.from_bytes(seq, "big"), "events": [_event(e) for e in batch.events]}), flush=True
            )
    req = ctx.socket(zmq.DEALER)
    req.connect(replay)
    req.send_multipart([b"", start.to_bytes(8, "big")])
    while req.poll(30_000):
        _, _, seq, payload = req.recv_multipart()
        if seq == END_SEQ:
            break
        batch = decode(payload)
        print(
            json.dumps({"replayed": int.from_bytes(seq, "big"), "events": [_event(e) for e in batch.events]}),
            flush=True,
        )
    print("end", flush=True)


if __name__ == "__main__":
    main()
