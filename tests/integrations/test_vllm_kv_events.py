"""KV events for routers: the host and disk tiers' blocks on vLLM's own event stream.

vLLM's OpenAI server runs with the ``kv_both`` connector (16 host slots, a disk tier) and
``--kv-events-config`` (ZMQ publisher, replay socket). A subscriber process decodes the
stream with vLLM's own classes (``vllm.distributed.kv_events.KVEventBatch``), as llm-d's
indexer or Dynamo's router would. Three 11-block prompts overflow the host tier, then the
first one comes back from disk. The stream must name every block saved to host (``CPU``) and
to disk (``STORAGE``) with its token ids and chained hashes, a ``BlockRemoved`` for every host
eviction, the disk hits' promotion back to host, and replay must return every batch.

A store node publishes its own stream in the same format (topic ``kv@<node>@<model>``); a
subscriber that restarts catches up through the replay socket from the next sequence it lacks.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from _vllm_engine import complete, free_port, openai_server, require_vllm
from tiersync.bench.serve_engine import make_prompt, vllm_python
from tiersync.bench.tiny_llama import write_tiny_llama
from tiersync.net.store_client import StoreNodeClient

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]
BLOCK, PROMPT_LEN, SLOTS = 128, 1500, 16  # 1500 tokens: 11 full blocks; 16 slots of 1.5 MiB
FULL = PROMPT_LEN // BLOCK
SUBSCRIBER = str(Path(__file__).with_name("_kv_subscriber.py"))


class Subscriber:
    """The subscriber process: live batches as they come, every batch again by replay at the end."""

    def __init__(self, pub: str, replay: str, topic: str = "kv", start: int = 0) -> None:
        self.proc = subprocess.Popen(
            [vllm_python(), SUBSCRIBER, pub, replay, topic, str(start)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout.readline().strip() == "ready"

    def finish(self) -> tuple[dict[int, list], dict[int, list]]:
        """Stop listening; replay; (live, replayed) batches by sequence number."""
        out, _ = self.proc.communicate("", timeout=120)
        live, replayed = {}, {}
        lines = out.splitlines()
        assert lines and lines[-1] == "end", lines[-3:]
        for line in lines[:-1]:
            msg = json.loads(line)
            (live if "seq" in msg else replayed)[msg.get("seq", msg.get("replayed"))] = msg["events"]
        return live, replayed


def _locate(prompts: list[list[int]], tokens: list[int]) -> tuple[int, int]:
    """(prompt, first block) whose blocks the event's token ids are."""
    for p, prompt in enumerate(prompts):
        for b in range(FULL):
            if prompt[b * BLOCK : b * BLOCK + len(tokens)] == tokens:
                return p, b
    raise AssertionError(f"token ids of no prompt's blocks: {tokens[:8]}...")


def test_host_and_disk_blocks_published_as_vllm_kv_events(tmp_path):
    require_vllm()
    model = write_tiny_llama(str(tmp_path / "model"))
    pub, replay = free_port(), free_port()
    events_cfg = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{replay}",
        "topic": "kv",
    }
    kv = {
        "kv_connector": "TierSyncConnector",
        "kv_role": "kv_both",
        "kv_connector_module_path": "tiersync.integrations.vllm",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"host_bytes": f"{SLOTS * 3 // 2}MiB", "storage_dir": str(tmp_path / "kv")},
    }
    prompts = [make_prompt(PROMPT_LEN, seed=s, vocab=1000) for s in (1, 2, 3)]
    with openai_server(model, kv, str(tmp_path / "server.log"), "--kv-events-config", json.dumps(events_cfg)) as srv:
        sub = Subscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
        first = [complete(srv, model, p) for p in prompts]
        assert complete(srv, model, prompts[0]) == first[0]  # A again: from disk, same tokens
        for _ in range(40):  # idle steps deliver the last disk writes' acknowledgements
            complete(srv, model, [5, 6, 7], max_tokens=2)
            time.sleep(0.25)
        live, replayed = sub.finish()
    assert sorted(replayed) == list(range(len(replayed))) and replayed, "replay returns every batch from 0"
    assert live and all(replayed[seq] == events for seq, events in live.items())
    _check_stream([e for seq in sorted(replayed) for e in replayed[seq]], prompts)


def _check_stream(events: list[dict], prompts: list[list[int]]) -> None:
    where: dict[object, tuple[int, int]] = {}  # block hash -> (prompt, block)
    history: dict[str, dict[tuple[int, int], list[str]]] = {"CPU": defaultdict(list), "STORAGE": defaultdict(list)}
    for e in events:
        if e["medium"] not in history:
            continue  # vLLM's own device events (none here: no prefix cache)
        if e["type"] == "BlockStored":
            assert e["block_size"] == BLOCK and len(e["token_ids"]) == BLOCK * len(e["block_hashes"])
            p, b = _locate(prompts, e["token_ids"])
            if b == 0:
                assert e["parent"] is None
            elif (p, b - 1) in where.values():
                assert where.get(e["parent"]) == (p, b - 1)  # chained to the block before
            for i, h in enumerate(e["block_hashes"]):
                assert where.setdefault(h, (p, b + i)) == (p, b + i)  # one hash, one block
                history[e["medium"]][(p, b + i)].append("stored")
        else:
            assert e["type"] == "BlockRemoved"
            for h in e["block_hashes"]:
                history[e["medium"]][where[h]].append("removed")
    every = {(p, b) for p in range(3) for b in range(FULL)}
    assert set(history["STORAGE"]) == every and all(h == ["stored"] for h in history["STORAGE"].values())
    cpu = history["CPU"]
    assert set(cpu) == every
    for block, h in cpu.items():  # stored, removed, stored, ...: never two in a row
        assert all(a != b for a, b in itertools.pairwise(h)) and h[0] == "stored", (block, h)
    live = [block for block, h in cpu.items() if h[-1] == "stored"]
    assert len(live) == SLOTS  # every eviction was announced: what is left fills the host tier
    assert all(cpu[(0, b)][:3] == ["stored", "removed", "stored"] for b in range(FULL))  # evicted, then a disk hit


def test_store_node_stream_and_replay_after_a_subscriber_restart():
    """A ``tiersync store-node`` process with --kv-events-endpoint/--kv-events-replay."""
    require_vllm()
    token, block = "t" * 32, 64 << 10
    node = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tiersync.cli",
            "store-node",
            "--capacity",
            str(64 * block),
            "--port",
            "0",
            "--block-size",
            str(block),
            "--kv-events-endpoint",
            "tcp://127.0.0.1:0",
            "--kv-events-replay",
            "tcp://127.0.0.1:0",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TIERSYNC_TOKEN": token},
    )
    try:
        line = node.stdout.readline()
        m = re.search(r"listening on (\S+) .*KV events on (\S+) \(replay (\S+), topic (\S+)\)", line)
        assert m, line
        address, pub, replay, topic = m.groups()
        assert topic == f"kv@{address}@*"
        client = StoreNodeClient(address, token=token)
        keys = [bytes([i]) * 16 for i in range(12)]
        first = Subscriber(pub, replay, topic)
        client.offer_and_push(keys[:4], [bytes([i]) * block for i in range(4)])
        live, replayed = first.finish()  # the subscriber goes away
        seen = max(replayed)
        client.offer_and_push(keys[4:], [bytes([i]) * block for i in range(4, 12)])  # missed while away
        client.offer_and_push(keys[:6], [bytes([i]) * block for i in range(6)])  # 4 held: 2 new
        _, caught_up = Subscriber(pub, replay, topic, start=seen + 1).finish()
    finally:
        node.terminate()
        assert node.wait(30) == 0
    assert replayed[0] == [{"type": "AllBlocksCleared", "block_hashes": [], "medium": None}]
    assert all(replayed[seq] == got for seq, got in live.items())
    assert sorted(caught_up) == list(range(seen + 1, seen + 1 + len(caught_up)))  # nothing skipped
    stored = [e for seq in sorted(replayed) for e in replayed[seq]] + [
        e for s in sorted(caught_up) for e in caught_up[s]
    ]
    hashes = [h for e in stored if e["type"] == "BlockStored" for h in e["block_hashes"]]
    assert hashes == [k.hex() for k in keys]  # every key once, in commit order (no re-announcement)
    assert {e["medium"] for e in stored if e["type"] == "BlockStored"} == {"CPU"}
