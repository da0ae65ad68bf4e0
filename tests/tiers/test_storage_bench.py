"""The storage bench: reports the contract's rows, refuses on a corrupt round trip."""

from __future__ import annotations

import tempfile

import pytest

from tiersync.bench.common import BenchConfig, RoundTripError
from tiersync.bench.storage import run


def test_tiny_bench_reports_rows_against_raw_io():
    with tempfile.TemporaryDirectory() as d:
        rep = run(BenchConfig(suite="storage", tiny=True), d)
    names = [r["name"] for r in rep["results"]]
    assert names == ["storage_write_64k", "storage_read_64k"]
    for r in rep["results"]:
        assert (
            r["gbps"] > 0
            and r["baseline_gbps"] > 0
            and r["ratio"] == pytest.approx(r["gbps"] / r["baseline_gbps"], rel=1e-2)
        )
    assert rep["suite"] == "storage" and "cold" in rep["cache"]


def test_bench_refuses_on_corruption():
    with tempfile.TemporaryDirectory() as d, pytest.raises(RoundTripError):
        run(BenchConfig(suite="storage", tiny=True, inject_corruption=True), d)


def test_quick_json_cli_rows_and_cold_reads():
    import json
    import os
    import subprocess
    import sys

    from tiersync import cli

    env = {**os.environ, cli.TINY_ENV: "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "tiersync.cli", "bench", "storage", "--quick", "--json"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    write, read = rep["results"]
    for r in (write, read):
        assert {"paired_ratio", "paired_ratio_p10", "paired_ratio_p90", "segment_bytes"} <= r.keys()
        assert r["paired_ratio_p10"] <= r["paired_ratio"] <= r["paired_ratio_p90"]
        assert r["resident_bytes_before_reads"] == 0  # every timed read of either side started cold
    assert read["raw_direct_gbps"] > 0 and write["raw_direct_gbps"] > 0 and "mincore" in rep["cache"]
