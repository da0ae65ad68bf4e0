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

ROW_KEYS = {
    "name",
    "gbps",
    "baseline",
    "baseline_gbps",
    "ratio",
    "gate_floor_gbps",
    "p50_ms",
    "p99_ms",
    "shards",
    "samplers",
    "transport",
    "nbytes",
    "seconds",
    "baseline_seconds",
    "aggregate_gbps",
    "baseline_aggregate_gbps",
    "raw_socket_gbps",
    "raw_socket_aggregate_gbps",
    "buffers",
    "roundtrip",
}


@pytest.fixture(scope="module")
def report():
    env = {**os.environ, cli.TINY_ENV: "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "tiersync.cli", "bench", "weights", "--quick", "--json"],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def test_report_top_level(report):
    assert report["suite"] == "weights" and report["mode"] == "tiny" and report["units"] == "decimal GB/s"
    assert report["roundtrip"]["ok"] is True and report["roundtrip"]["cases"] == 2
    assert report["model"]["dtype"] == "bfloat16" and report["model"]["nbytes"] > 0
    assert {"memory", "targets", "buffers", "memcpy_1thread_gbps"} <= report.keys()


def test_rows_follow_the_contract(report):
    rows = report["results"]
    assert {r["name"] for r in rows} == {f"weights-{s}t-2s-{w}" for s in (1, 2) for w in ("shm", "tcp")} | {
        "weights-1t-2s-shm-zerocopy",
        "weights-1t-2s-tcp-vs-raw",
    }
    for r in rows:
        assert r.keys() >= ROW_KEYS, ROW_KEYS - r.keys()
        baseline = "raw loopback sockets" if r["name"].endswith("-vs-raw") else "torch.distributed.broadcast"
        assert r["baseline"].startswith(baseline) and r["roundtrip"] == "ok"
        assert r["gbps"] > 0 and r["baseline_gbps"] > 0 and r["raw_socket_gbps"] > 0
        assert math.isclose(r["ratio"], r["gbps"] / r["baseline_gbps"], rel_tol=2e-3, abs_tol=2e-4)
        assert math.isclose(r["aggregate_gbps"], r["gbps"] * r["samplers"], rel_tol=2e-3, abs_tol=2e-4)
        assert r["nbytes"] == report["model"]["nbytes"]
        assert r["seconds"] > 0 and r["p50_ms"] <= r["p99_ms"]


def test_tcp_vs_raw_row_is_the_tcp_run_against_the_same_run_raw_sockets(report):
    """In quick and full mode this is ``weights-1t-4s-tcp-vs-raw``; tiny mode has 2 samplers."""
    rows = {r["name"]: r for r in report["results"]}
    vs_raw, tcp = rows["weights-1t-2s-tcp-vs-raw"], rows["weights-1t-2s-tcp"]
    assert vs_raw["transport"] == tcp["transport"] == "tcp forced" and vs_raw["shards"] == 1
    assert vs_raw["gbps"] == tcp["gbps"] and vs_raw["seconds"] == tcp["seconds"]
    assert vs_raw["baseline_gbps"] == tcp["raw_socket_gbps"] == vs_raw["raw_socket_gbps"]
    assert vs_raw["baseline_seconds"] == vs_raw["raw_socket_seconds"]
    assert math.isclose(vs_raw["ratio"], tcp["gbps"] / tcp["raw_socket_gbps"], rel_tol=2e-3, abs_tol=2e-4)
    assert vs_raw["gloo_gbps"] == tcp["baseline_gbps"]
