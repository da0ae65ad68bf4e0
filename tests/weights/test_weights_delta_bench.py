"""``tiersync bench weights --quick --json --cases delta`` with tiny shapes, as a real subprocess:
the delta rows follow the bench contract (never the speed is checked)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from tiersync import cli


def _bench(*extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, cli.TINY_ENV: "1"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tiersync.cli",
            "bench",
            "weights",
            "--quick",
            "--json",
            "--cases",
            "delta",
            "--iterations",
            "2",
            *extra,
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_delta_rows_refuse_to_report_when_the_byte_exact_check_fails():
    proc = _bench("--inject-corruption")
    out = json.loads(proc.stdout)
    assert proc.returncode == 3 and out["refused"] is True and "results" not in out
    assert "differ from the source" in out["error"]


def test_delta_rows_follow_the_contract():
    proc = _bench()
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    rows = {r["name"]: r for r in report["results"]}
    assert set(rows) == {f"weights-1t-4s-delta-{p}pct" for p in (1, 10, 100)}
    nbytes = report["model"]["nbytes"]
    for r in rows.values():
        assert r["roundtrip"] == "ok" and r["baseline"].startswith("full sync") and r["samplers"] == 4
        assert r["gbps"] > 0 and r["baseline_gbps"] > 0 and r["samples"] == 4  # 2 rounds x 2 timed versions
        assert math.isclose(r["ratio"], r["gbps"] / r["baseline_gbps"], rel_tol=2e-3, abs_tol=2e-4)
        assert r["baseline_moved_bytes"] == r["nbytes"] == nbytes
        assert 0 < r["moved_bytes"] <= nbytes and r["changed_chunks"] <= r["chunks"]
    assert rows["weights-1t-4s-delta-1pct"]["moved_bytes"] < nbytes  # a few chunks, not the model
    assert rows["weights-1t-4s-delta-100pct"]["moved_bytes"] == nbytes
