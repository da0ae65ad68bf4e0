"""Run test code in a fresh interpreter (for imports that change process-wide state)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

import tiersync


def run_without_leaking_jax(code: str) -> None:
    """Run ``code`` in a fresh interpreter: importing jax loads ml_dtypes, which registers
    ``bfloat16`` and friends with numpy for the rest of the process and would change what
    other suites (e.g. tests/weights) see."""
    if importlib.util.find_spec("jax") is None:
        pytest.skip("jax is not installed")
    src = os.path.dirname(os.path.dirname(tiersync.__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], check=False, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("OK"), proc.stdout
