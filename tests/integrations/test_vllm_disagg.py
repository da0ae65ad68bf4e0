"""Prefill -> decode with TierSyncConnector on real vLLM engines: a prefill engine
(kv_producer), a decode engine (kv_consumer) and an HTTP router, each its own process.

The prefill engine doubles as the monolithic reference: a request without
``do_remote_decode`` is computed and decoded there like on any engine.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from _vllm_engine import CHUNK, PROMPT_LEN, require_vllm
from tiersync.bench.engine_server import start
from tiersync.bench.serve_engine import make_prompt, vllm_python
from tiersync.bench.tiny_llama import write_tiny_llama
from tiersync.disagg import DisaggConfig, KVConsumer, RequestState, SourceSpec

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]
BLOCK = 128
PD_PORT = 17611


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    require_vllm()
    work = tmp_path_factory.mktemp("pd")
    model = write_tiny_llama(str(work / "model"))
    base = {"model": model, "chunk": CHUNK, "connector": "tiersync"}
    py = vllm_python()
    import json

    servers = {}
    try:
        servers["prefill"] = start(
            ["engine", json.dumps({**base, "kv_role": "kv_producer", "extra": {"pd_port": PD_PORT}}), "0"],
            str(work / "prefill.log"),
            py,
        )
        servers["decode"] = start(  # with vLLM's prefix cache, as vLLM runs by default
            ["engine", json.dumps({**base, "kv_role": "kv_consumer", "prefix_cache": True}), "0"],
            str(work / "decode.log"),
            py,
        )
        servers["router"] = start(
            ["router", servers["prefill"].url, servers["decode"].url, "0"], str(work / "router.log"), py
        )
        yield servers
    finally:
        for s in servers.values():
            s.kill()


def test_prefill_to_decode_matches_monolithic(cluster):
    prompt = make_prompt(PROMPT_LEN, 7, 4096)
    mono = cluster["prefill"].generate(prompt, 24)
    out = cluster["router"].generate(prompt, 24)  # the first token from prefill, decode from prompt + it
    assert out["prefill"]["kv_transfer_params"]["tiersync_source"]["request_id"]
    assert PROMPT_LEN % BLOCK and out["cached_tokens"] == PROMPT_LEN  # every prompt token, the partial block too
    assert out["tokens"] == mono["tokens"]


def test_decode_with_the_first_blocks_in_its_prefix_cache_pulls_the_rest(cluster):
    shared = make_prompt(PROMPT_LEN, 12, 4096)
    cluster["router"].generate(shared, 2)  # the decode engine now caches its full blocks
    prompt = shared[: 32 * BLOCK] + make_prompt(PROMPT_LEN - 32 * BLOCK, 13, 4096)
    mono = cluster["prefill"].generate(prompt, 16)
    out = cluster["router"].generate(prompt, 16)
    assert out["cached_tokens"] == PROMPT_LEN  # 32 blocks of its own, the rest pulled
    assert out["tokens"] == mono["tokens"]


def test_decode_given_the_same_prompt_loads_all_but_the_last_token(cluster):
    prompt = make_prompt(PROMPT_LEN, 9, 4096)
    mono = cluster["prefill"].generate(prompt, 24)
    params = cluster["prefill"].generate(prompt, 1, {"do_remote_decode": True})["kv_transfer_params"]
    out = cluster["decode"].generate(prompt, 24, params)
    assert out["cached_tokens"] == PROMPT_LEN - 1  # the partial block too; vLLM computes the last token
    # that token's K/V come from a one-token forward: equal up to the last bits (wrong KV: ~0.05)
    assert out["tokens"][:4] == mono["tokens"][:4]
    assert max(abs(a - b) for a, b in zip(out["logprobs"][:4], mono["logprobs"][:4])) < 1e-3


def test_decode_given_another_prompt_loads_nothing(cluster):
    prompt, other = make_prompt(PROMPT_LEN, 10, 4096), make_prompt(PROMPT_LEN, 11, 4096)
    first = cluster["prefill"].generate(prompt, 1, {"do_remote_decode": True})
    mono = cluster["prefill"].generate(other + first["tokens"], 8)
    out = cluster["decode"].generate(other + first["tokens"], 8, first["kv_transfer_params"])
    assert out["cached_tokens"] == 0  # the digest of the prefill's prompt differs: a miss, not its KV
    assert out["tokens"] == mono["tokens"]
    # the decode engine told the prefill engine (KV_DROP) it will not read that KV: it is served no
    # more, long before load_timeout_s (120 s); a prompt nobody dropped is still served
    assert _read_at_prefill(first["kv_transfer_params"]) is RequestState.FAILED
    kept = cluster["prefill"].generate(make_prompt(PROMPT_LEN, 14, 4096), 1, {"do_remote_decode": True})
    assert _read_at_prefill(kept["kv_transfer_params"]) is RequestState.DONE


def _read_at_prefill(params: dict) -> RequestState:
    """Read a prefilled prompt's KV from the prefill engine as a decode rank would."""
    raw = params["tiersync_source"]
    source = SourceSpec.from_dict(raw["source"])
    blocks = len(source.block_ids)
    layout = dataclasses.replace(source.layout, num_blocks=blocks)
    landing = [np.zeros(layout.layer_nbytes, np.uint8) for _ in range(layout.num_layers)]
    with KVConsumer(layout, 0, DisaggConfig(timeout_s=30)) as consumer:
        return consumer.start_read(raw["request_id"], source, list(range(blocks)), landing).wait(60)


def test_prefill_killed_before_the_pull_decode_recomputes(cluster):
    prompt = make_prompt(PROMPT_LEN, 8, 4096)
    mono = cluster["prefill"].generate(prompt, 24)
    first = cluster["prefill"].generate(prompt, 1, {"do_remote_decode": True})
    params = first["kv_transfer_params"]
    assert params and "tiersync_source" in params
    cluster["prefill"].kill()  # the KV server dies with it: the pull fails
    out = cluster["decode"].generate(prompt, 24, params)
    assert out["tokens"] == mono["tokens"]
