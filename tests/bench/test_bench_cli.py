"""``tiersync bench`` and the CLI, run as real subprocesses with tiny shapes.

No timing assertions: only the contract (one JSON object, the row schema,
ratio = gbps / baseline_gbps, the round trip ran) and the refusal on corruption.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import types

import pytest

from tiersync import cli

ROW_KEYS = {
    "name",
    "gbps",
    "baseline",
    "baseline_gbps",
    "ratio",
    "gate_floor_gbps",
    "baseline_gate_floor_gbps",
    "p50_ms",
    "p90_ms",
    "p99_ms",
    "method",
    "direction",
    "nbytes",
    "roundtrip",
}
TOP_KEYS = {"suite", "kernel", "machine", "units", "iterations", "warmups", "results", "roundtrip", "telemetry"}


def _tiersync(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, cli.TINY_ENV: "1"}
    return subprocess.run(
        [sys.executable, "-m", "tiersync.cli", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.fixture(scope="module", params=["d2h", "h2d"])
def report(request):
    proc = _tiersync("bench", request.param, "--quick", "--json")
    assert proc.returncode == 0, proc.stderr
    return request.param, json.loads(proc.stdout)  # exactly one JSON object, nothing else on stdout


def test_report_top_level(report):
    suite, rep = report
    from tiersync.transfer.kernel import KERNEL

    assert rep.keys() >= TOP_KEYS
    assert rep["suite"] == suite and rep["kernel"] == KERNEL and rep["mode"] == "tiny"
    assert rep["units"] == "decimal GB/s"
    assert {"cpu_count", "python", "numpy"} <= rep["machine"].keys()
    assert rep["iterations"] >= 1 and rep["warmups"] >= 0


def test_rows_follow_the_contract(report):
    suite, rep = report
    rows = rep["results"]
    assert rows and all(r.keys() >= ROW_KEYS for r in rows)
    for r in rows:
        assert r["direction"] == suite and r["baseline"] == "memcpy" and r["roundtrip"] == "ok"
        assert r["gbps"] > 0 and r["baseline_gbps"] > 0
        assert math.isclose(r["ratio"], r["gbps"] / r["baseline_gbps"], rel_tol=2e-3, abs_tol=2e-4)
        assert r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"]
        assert r["gate_floor_gbps"] <= r["gbps"]


def test_every_case_has_engine_and_naive_rows(report):
    _, rep = report
    rows = rep["results"]
    engine = {r["name"] for r in rows if r["method"] == "engine"}
    naive = {r["name"].removesuffix("/naive-loop") for r in rows if r["method"] == "naive-loop"}
    assert engine == naive and len(engine) == rep["roundtrip"]["cases"]
    groups = {r["group"] for r in rows}
    assert {"reference", "acceptance", "large", "dtype", "block-size"} <= groups
    assert {r["dtype"] for r in rows} >= {"fp16", "bf16", "fp32", "int8"}
    assert any(r["scatter"] == "both" for r in rows) and any(r["strided"] for r in rows)


def test_round_trip_ran_and_engine_reported_metrics(report):
    suite, rep = report
    assert rep["roundtrip"]["ok"] is True and rep["roundtrip"]["checked_bytes"] > 0
    tel = rep["telemetry"]
    assert tel["d2h"]["transfers"] > 0 and tel["h2d"]["transfers"] > 0  # the round trip does both
    assert tel[suite]["failures"] == 0


@pytest.mark.parametrize("suite", ["d2h", "h2d"])
def test_corrupted_round_trip_refuses(suite):
    proc = _tiersync("bench", suite, "--quick", "--json", "--inject-corruption")
    assert proc.returncode == cli.EXIT_REFUSED
    assert "REFUSED" in proc.stderr and "byte-exact" in proc.stderr
    out = json.loads(proc.stdout)
    assert out["refused"] is True and "results" not in out


def test_table_output():
    proc = _tiersync("bench", "d2h", "--iterations", "1", "--warmups", "0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("tiersync bench d2h") and "acc-64k-bf16/naive-loop" in proc.stdout


def test_bad_workers_is_a_usage_error():
    proc = _tiersync("bench", "d2h", "--workers", "0")
    assert proc.returncode == cli.EXIT_USAGE and "--workers" in proc.stderr


def test_import_is_cheap():
    code = "import sys, tiersync.cli; print(sorted(m for m in ('numpy', 'torch', 'tqdm') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_cli_suites_match_bench_registry():
    from tiersync.bench import SUITES

    assert set(cli.BENCH_SUITES) == set(SUITES)


def test_demo_forwards_flags(monkeypatch):
    seen = []
    fake = types.ModuleType("tiersync.demo")
    fake.main = lambda argv: seen.append(list(argv)) or 0
    monkeypatch.setitem(sys.modules, "tiersync.demo", fake)
    import tiersync

    monkeypatch.setattr(tiersync, "demo", fake, raising=False)
    assert cli.main(["demo", "--quick", "--json"]) == 0
    assert cli.main(["demo"]) == 0
    assert seen == [["--quick", "--json"], []]


def test_shm_list_empty_dir_and_reclaim_refusal(tmp_path, capsys):
    assert cli.main(["shm", "list", "--dir", str(tmp_path)]) == 0
    assert "no tiersync segments" in capsys.readouterr().out
    assert cli.main(["shm", "list", "--dir", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
    assert cli.main(["shm", "reclaim", str(tmp_path / "not-a-segment")]) == cli.EXIT_ERROR


def test_metrics_prints_exposition(capsys):
    assert cli.main(["metrics"]) == 0
    out = capsys.readouterr().out
    assert "# TYPE tiersync_transfer_seconds histogram" in out and "tiersync_buffer_allocated_bytes" in out


def test_no_command_prints_help():
    assert cli.main([]) == cli.EXIT_USAGE


def test_gate_floor_and_percentiles():
    from tiersync.bench.common import gate_floor, median, percentile

    vals = [10.0, 11.0, 9.0, 10.0, 30.0]
    assert median(vals) == 10.0
    assert gate_floor(vals) == pytest.approx(10.0 - 3.5 * 1.4826 * 1.0)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([5.0], 99) == 5.0


@pytest.mark.torch
def test_bf16_pools_via_torch_round_trip():
    pytest.importorskip("torch")
    from tiersync.bench.common import RoundTripError
    from tiersync.bench.kvfixture import Case, build, round_trip

    case = Case("t", (2, 8, 2, 128), "bf16", layers=2, moved=4, group="test", split_kv=True)
    fx = build(case, workers=1, seed=3)
    try:
        assert fx.backend == "torch"
        assert round_trip(fx)["ok"] is True
        with pytest.raises(RoundTripError, match="byte-exact"):
            round_trip(fx, corrupt=True)
    finally:
        fx.close()
