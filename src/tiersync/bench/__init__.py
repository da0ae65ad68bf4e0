"""Benchmark suites behind ``tiersync bench SUITE``.

``SUITES`` maps a suite name to the module that runs it (imported only when the
suite runs, so importing this package costs nothing). Every suite module has
``run(config: BenchConfig) -> dict`` and follows the contract in
:mod:`tiersync.bench.common`: one JSON object, a byte-exact check before any
number, ``ratio = ours / baseline`` per row.
"""

from __future__ import annotations

from typing import Any

SUITES: dict[str, str] = {
    "d2h": "tiersync.bench.copy",
    "h2d": "tiersync.bench.copy",
    "storage": "tiersync.bench.storage",
    "h2h": "tiersync.bench.h2h",
    "pd": "tiersync.bench.pd",
    "registry": "tiersync.bench.registry",
    "weights": "tiersync.bench.weights",
    "serve": "tiersync.bench.serve",
    "workload": "tiersync.bench.workload",
}


def run_suite(config: Any) -> dict[str, Any]:
    """Run ``config.suite`` (a :class:`~tiersync.bench.common.BenchConfig`); returns its report."""
    import importlib

    from tiersync.errors import UsageError

    module = SUITES.get(config.suite)
    if module is None:
        raise UsageError("unknown suite", argument="suite", value=config.suite, choices=sorted(SUITES))
    rep = importlib.import_module(module).run(config)
    if config.cases is not None and not rep.get("results"):  # suites without their own check (copy, weights have one)
        raise UsageError("no case matches", argument="--cases", value=config.cases)
    return rep
