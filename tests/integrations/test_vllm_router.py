"""``tiersync router`` in front of two vLLM OpenAI servers: prefill (kv_producer) -> decode (kv_consumer).

Real processes: both engines run vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``)
with ``--kv-transfer-config``; the router is the ``tiersync router`` command. A client sends
``/v1/completions`` to the router (plain and streamed): the greedy tokens equal the prefill
server's own answer for the prompt alone (monolithic), the first of them the prefill server's,
and the decode server counts every prompt token as an external prefix-cache hit (it pulled
them all, the partial last block too, and computed only the first token's K/V).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from _vllm_engine import complete, free_port, metrics, openai_server, require_vllm, settled_total, total
from tiersync.bench.engine_server import Server, post
from tiersync.bench.serve_engine import make_prompt
from tiersync.bench.tiny_llama import write_tiny_llama

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]
PROMPT_LEN = 1500  # not a multiple of the 128-token block: the last block is partial
PULLED = PROMPT_LEN  # the decode engine's prompt is this one and the first token: it computes only that


def _kv(role: str, **extra: object) -> dict:
    return {
        "kv_connector": "TierSyncConnector",
        "kv_role": role,
        "kv_connector_module_path": "tiersync.integrations.vllm",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"pd_token": "router-test-token-0123456", **extra},
    }


def _stream(url: str, body: dict) -> list[int]:
    """The token ids of a streamed completion (server-sent events), in order."""
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    tokens = []
    with urllib.request.urlopen(request, timeout=600) as answer:
        for line in answer:
            line = line.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    tokens += choice.get("token_ids") or []
    return tokens


def _kv_usage_settles_at_zero(srv: Server, timeout: float = 20) -> bool:
    """Whether the engine's KV pool becomes empty within ``timeout`` s (it records a step's stats
    after the step); a prompt pinned for a decode engine would keep it above zero for
    ``load_timeout_s`` (120 s)."""
    deadline = time.monotonic() + timeout
    while total(metrics(srv), "vllm:kv_cache_usage_perc") > 0:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def test_router_serves_prefill_then_decode_with_monolithic_tokens(tmp_path):
    require_vllm()
    model = write_tiny_llama(str(tmp_path / "model"))
    prompt = make_prompt(PROMPT_LEN, seed=7, vocab=1000)
    with (
        openai_server(
            model, _kv("kv_producer", pd_port=free_port()), str(tmp_path / "prefill.log"), tokenizer=True
        ) as prefill,
        openai_server(model, _kv("kv_consumer"), str(tmp_path / "decode.log"), tokenizer=True) as decode,
    ):
        router = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tiersync.cli",
                "router",
                "--prefill",
                prefill.url,
                "--decode",
                decode.url,
                "--port",
                "0",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            line = router.stdout.readline()
            assert "listening on" in line, line
            srv = Server(router, "http://" + line.split("listening on ")[1].split()[0], "")
            monolithic = complete(prefill, model, prompt, max_tokens=12)
            assert complete(srv, model, prompt, max_tokens=12) == monolithic
            body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
            assert _stream(srv.url, body) == monolithic
            assert settled_total(decode, "vllm:external_prefix_cache_hits_total", 2 * PULLED) == 2 * PULLED
            plain = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0}  # text, no ids
            text = post(prefill.url + "/v1/completions", plain)["choices"][0]["text"]
            assert text and post(srv.url + "/v1/completions", plain)["choices"][0]["text"] == text
            # a first token that ends the answer (here a stop token): the router answers with it
            # alone and no decode engine reads that prompt's KV, so the prefill engine frees it
            # at once instead of pinning it for load_timeout_s
            first = monolithic[0]
            stop = {**plain, "stop_token_ids": [first], "include_stop_str_in_output": True}
            ended = post(srv.url + "/v1/completions", {**stop, "return_token_ids": True})["choices"][0]
            assert ended["finish_reason"] == "stop" and ended["token_ids"] == [first]
            assert _kv_usage_settles_at_zero(prefill)
            asked = post(prefill.url + "/v1/completions", {**stop, "kv_transfer_params": {"do_remote_decode": True}})
            assert asked.get("kv_transfer_params") is None  # as a router's prefill request: nothing to read
            assert _kv_usage_settles_at_zero(prefill)
            with pytest.raises(urllib.error.HTTPError) as ei:
                post(srv.url + "/v1/nothing", {})
            assert ei.value.code == 404
        finally:
            router.terminate()
            assert router.wait(30) == 0
