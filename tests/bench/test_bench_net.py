"""``tiersync bench h2h`` and ``bench registry`` as real subprocesses, tiny shapes (loopback only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROW_KEYS = {"name", "gbps", "baseline", "baseline_gbps", "ratio"}


def _bench(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TIERSYNC_BENCH_TINY": "1"}
    return subprocess.run(
        [sys.executable, "-m", "tiersync.cli", "bench", *args, "--json"],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_h2h_rows_follow_the_contract():
    out = _bench("h2h")
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["suite"] == "h2h" and rep["roundtrip"]["ok"]
    names = {r["name"] for r in rep["results"]}
    assert set(rep["target"]) == names & {
        "h2h-64k-4s-w8",
        "h2h-1m-4s-w8",
        "h2h-16m-4s-w8",
        "h2h-64k-local",
        "h2h-1m-local",
        "h2h-16m-local",
    }
    for name, goal in rep["target"].items():  # each row judged against its own baseline
        row = next(r for r in rep["results"] if r["name"] == name)
        assert goal == {
            "min_ratio": 0.6 if name.endswith("-local") else 0.8,
            "ratio": row["ratio"],
            "met": row["ratio"] >= goal["min_ratio"],
        }
    assert {"h2h-64k-1s", "h2h-64k-4s", "h2h-1m-1s", "h2h-1m-4s"} <= names
    assert {"h2h-64k-1s-w8", "h2h-1m-4s-w8"} <= names  # pipelined rows, both sides windowed
    assert {r["window"] for r in rep["results"]} == {1, 8}
    local = [r for r in rep["results"] if r["name"].endswith("-local")]
    assert {r["name"] for r in local} >= {"h2h-64k-local", "h2h-1m-local"}  # the same-host route has rows
    for r in rep["results"]:
        base = "memcpy" if r in local else "raw-socket"
        assert set(r) >= ROW_KEYS and r["baseline"] == base and r["gbps"] > 0
        assert r["ratio"] == pytest.approx(r["gbps"] / r["baseline_gbps"], rel=1e-2)
        assert r["p99_ms"] >= r["p50_ms"] > 0
        assert r["payload_checksum"].split()[0] in {"TSUM64", "XXH3_64"}  # every payload is verified


def test_h2h_corruption_refuses():
    out = _bench("h2h", "--inject-corruption", "--cases", "64k-1s")
    assert out.returncode == 3 and json.loads(out.stdout)["refused"] is True


def test_registry_rows_carry_their_unit():
    out = _bench("registry")
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["units"] == "lookups/s" and rep["results"]
    for r in rep["results"]:
        assert set(r) >= ROW_KEYS and r["unit"] == "lookups/s" and r["baseline"] == "dict-lookup-loop"
        assert r["gbps"] > 0 and r["ratio"] > 0


def test_registry_corruption_refuses():
    assert _bench("registry", "--inject-corruption").returncode == 3


def test_pd_rows_follow_the_contract():
    out = _bench("pd")
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["suite"] == "pd" and rep["roundtrip"]["ok"]
    rows = {r["name"]: r for r in rep["results"]}
    assert set(rows) == {"pd-link-tcp", "pd-link-local"}
    assert rows["pd-link-tcp"]["baseline"] == "raw-socket" and rows["pd-link-local"]["baseline"] == "memcpy"
    for r in rows.values():
        assert set(r) >= ROW_KEYS and r["gbps"] > 0 and r["roundtrip"] == "ok"
        assert r["ratio"] == pytest.approx(r["gbps"] / r["baseline_gbps"], rel=1e-2)
        assert set(rep["target"][r["name"]]) == {"min_ratio", "ratio", "met"}


def test_pd_corruption_refuses():
    out = _bench("pd", "--inject-corruption", "--cases", "pd-link-tcp")
    assert out.returncode == 3 and json.loads(out.stdout)["refused"] is True
