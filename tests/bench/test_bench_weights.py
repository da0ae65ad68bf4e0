"""``tiersync bench weights --quick --json`` with tiny shapes, as a real subprocess.

Only the contract is checked (one JSON object, the row schema, ratio = gbps / baseline_gbps,
the byte-exact check ran, gloo and the raw socket figure were measured), never the speed.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tiersync import cli

ROW_KEYS = {"name", "gbps", "baseline", "baseline_gbps", "ratio", "gate_floor_gbps", "p50_ms", "p99_ms",
            "shards", "samplers", "transport", "nbytes", "seconds", "baseline_seconds", "aggregate_gbps",
            "baseline_aggregate_gbps", "raw_socket_gbps", "raw_socket_aggregate_gbps", "buffers", "roundtrip"}


@pytest.fixture(scope="module")
def report():
    env = {**os.environ, cli.TINY_ENV: "1"}
    proc = subprocess.run([sys.executable, "-m", "tiersync.cli", "bench", "weights", "--quick", "--json"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def test_report_top_level(report):
    assert report["suite"] == "weights" and report["mode"] == "tiny" and report["units"] == "decimal GB/s"
    assert report["roundtrip"]["ok"] is True and report["roundtrip"]["cases"] == 2
    assert report["model"]["dtype"] == "bfloat16" and report["model"]["nbytes"] > 0
    assert {"memory", "targets", "buffers", "memcpy_1thread_gbps"} <= report.keys()


def test_rows_follow_the_contract(report):
    rows = report["results"]
    assert {r["name"] for r in rows} == {f"weights-{s}t-2s-{w}" for s in (1, 2) for w in ("shm", "tcp")} | \
        {"weights-1t-2s-shm-zerocopy"}
    for r in rows:
        assert ROW_KEYS <= r.keys(), ROW_KEYS - r.keys()
        assert r["baseline"].startswith("torch.distributed.broadcast") and r["roundtrip"] == "ok"
        assert r["gbps"] > 0 and r["baseline_gbps"] > 0 and r["raw_socket_gbps"] > 0
        assert math.isclose(r["ratio"], r["gbps"] / r["baseline_gbps"], rel_tol=2e-3, abs_tol=2e-4)
        assert math.isclose(r["aggregate_gbps"], r["gbps"] * r["samplers"], rel_tol=2e-3, abs_tol=2e-4)
        assert r["nbytes"] == report["model"]["nbytes"]
        assert r["seconds"] > 0 and r["p50_ms"] <= r["p99_ms"]
