"""The serving examples, run as a user runs them: each script starts vLLM's OpenAI server(s)
(and ``tiersync router``) and talks HTTP; each exits 0 only when the greedy tokens are identical
to those of a server without a connector (offload) or of the prefill server alone (prefill ->
decode). Small prompts keep CI short; the scripts are unchanged."""

from __future__ import annotations

import os
import subprocess

import pytest

from _vllm_engine import require_vllm
from tiersync.bench.serve_engine import engine_env, vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]
EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")


@pytest.mark.parametrize(
    ("script", "args", "verdict"),
    [
        (
            "host_offload/run.py",
            ["--prompt-tokens", "1500", "--output-tokens", "4"],
            "identical to the server without a connector in every phase: True",
        ),
        (
            "single_host_disagg/run.py",
            ["--prompt-tokens", "1500", "--output-tokens", "4", "--requests", "1"],
            "tokens identical: True",
        ),
    ],
)
def test_example_runs_on_the_openai_server(script, args, verdict, tmp_path):
    require_vllm()
    run = subprocess.run(
        [vllm_python(), os.path.join(EXAMPLES, script), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=1200,
        env={**engine_env({}), "TMPDIR": str(tmp_path)},
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert verdict in run.stdout, run.stdout
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("tiersync-")] == []  # its work dir is gone
