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
        assert r["gbps"] > 0 and r["baseline_gbps"] > 0 and r["ratio"] == pytest.approx(
            r["gbps"] / r["baseline_gbps"], rel=1e-2)
    assert rep["suite"] == "storage" and "cold" in rep["cache"]


def test_bench_refuses_on_corruption():
    with tempfile.TemporaryDirectory() as d, pytest.raises(RoundTripError):
        run(BenchConfig(suite="storage", tiny=True, inject_corruption=True), d)
