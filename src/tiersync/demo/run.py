"""The demo scenario: prefix reuse of a KV cache through the host tier.

1. Request 1 prefills a long prompt; its KV is scattered into a paged pool
   (the "device") and its full blocks are offloaded (d2h) to a host arena,
   each published under a chained prefix key.
2. Request 2 shares the first ``shared_tokens`` tokens. The pool is wiped, the
   longest prefix of blocks found on the host is copied (h2d) into *other*
   device blocks, a cache is rebuilt from them and only the suffix is run.
3. Its next-token logits must match a full recompute of request 2's prompt.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tiersync.demo.model import TinyModel, cache_layers, load_config
from tiersync.demo.paged import PagedKV, PrefixIndex, block_keys
from tiersync.tiers.host import HostArena
from tiersync.transfer import TransferEngine

ATOL, RTOL = 1e-4, 1e-5


@dataclass(frozen=True)
class Settings:
    """One demo run. ``shared_tokens`` of the two prompts are equal; the rest differ."""

    prompt_tokens: int = 4096
    shared_tokens: int = 3800
    block_size: int = 16
    seed: int = 0
    repeats: int = 1  # TTFT and h2d are timed this many times; the fastest run is reported
    inject_fault: bool = False  # corrupt one host block: the check must then FAIL
    model_overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.shared_tokens < self.prompt_tokens:
            raise ValueError("need 0 < shared_tokens < prompt_tokens")
        if self.repeats < 1:
            raise ValueError("need repeats >= 1")
        if self.block_size <= 0 or self.prompt_tokens < self.block_size:
            raise ValueError("need prompt_tokens >= block_size > 0")


@dataclass
class Rig:
    """Everything one run holds: model, device pool, host arena, engine, prefix map."""

    settings: Settings
    model: TinyModel
    paged: PagedKV
    arena: HostArena
    engine: TransferEngine
    index: PrefixIndex
    root: bytes

    def close(self) -> None:
        self.engine.close()
        self.arena.close()


def build_rig(s: Settings) -> Rig:
    """Model, a pool with room for both requests side by side, and a host arena for request 1."""
    model = TinyModel(load_config(s.model_overrides), seed=s.seed)
    per_request = -(-s.prompt_tokens // s.block_size)
    paged = PagedKV(model.geometry, 2 * per_request, s.block_size)
    index = PrefixIndex()
    arena = HostArena.for_layout(paged.layout, 2 * per_request, on_evict=index.forget)
    arena.memory[:] = 0  # fault the pages in now, as a server does at start-up, not inside the first d2h
    engine = TransferEngine(paged.layout, arena)
    return Rig(s, model, paged, arena, engine, index, root=paged.layout.digest())


def make_prompts(s: Settings, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of ``prompt_tokens`` random ids sharing the first ``shared_tokens``."""
    gen = torch.Generator().manual_seed(s.seed + 1)
    first = torch.randint(0, vocab, (s.prompt_tokens,), generator=gen)
    second = first.clone()
    tail = second[s.shared_tokens:]
    tail.copy_((tail + 1 + torch.randint(0, vocab - 1, tail.shape, generator=gen)) % vocab)  # differs everywhere
    return first, second


def coalesce(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """``(src, dst, count)`` runs of block pairs; pairs consecutive on both sides merge."""
    runs: list[list[int]] = []
    for a, b in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == a and runs[-1][1] + runs[-1][2] == b:
            runs[-1][2] += 1
        else:
            runs.append([a, b, 1])
    return [tuple(r) for r in runs]


def offload(rig: Rig, tokens: torch.Tensor, device_blocks: list[int]) -> dict[str, Any]:
    """d2h the full blocks of ``tokens`` (in ``device_blocks``) and publish them by prefix key."""
    keys = block_keys(tokens.tolist(), rig.paged.block_size, rig.root)
    host = rig.arena.allocate(len(keys))
    t0 = time.perf_counter()
    fut = rig.engine.d2h(coalesce(device_blocks[: len(keys)], host))
    fut.result(timeout=120)
    seconds = time.perf_counter() - t0
    rig.arena.publish(host, keys)
    rig.index.record(keys, host)
    rig.arena.allocator.unlock(host)  # cached: evictable from now on
    return {"blocks": len(keys), "bytes": fut.nbytes, "seconds": seconds, "host_blocks": host}


def request_one(rig: Rig, tokens: torch.Tensor) -> dict[str, Any]:
    """Prefill request 1, page its KV into blocks 0.., offload the full blocks."""
    t0 = time.perf_counter()
    _, cache = rig.model.forward(tokens)
    prefill_s = time.perf_counter() - t0
    layers = cache_layers(cache)
    device_blocks = list(range(-(-len(tokens) // rig.paged.block_size)))
    rig.paged.scatter(layers, device_blocks)
    out = offload(rig, tokens, device_blocks)
    if rig.settings.inject_fault:
        rig.arena.memory[out["host_blocks"][0]].view(np.float32)[:] += 1.0
    return {**out, "prefill_s": prefill_s, "device_blocks": device_blocks, "layers": layers}


def load_prefix(rig: Rig, tokens: torch.Tensor, first_device_block: int) -> dict[str, Any]:
    """Find the longest host prefix of ``tokens`` (leaving >= 1 token to run) and h2d it."""
    bs = rig.paged.block_size
    keys = block_keys(tokens.tolist(), bs, rig.root)[: (len(tokens) - 1) // bs]
    host = rig.index.longest_prefix(keys)
    stale = [i for i, (b, k) in enumerate(zip(host, keys)) if rig.arena.key_of(b) != k]
    host = host[: stale[0]] if stale else host  # trust only what the arena says it published
    if not host:
        return {"blocks": 0, "bytes": 0, "seconds": 0.0, "device_blocks": []}
    rig.arena.allocator.lock(host)  # pin for the copy
    try:
        device = list(range(first_device_block, first_device_block + len(host)))
        t0 = time.perf_counter()
        fut = rig.engine.h2d(coalesce(host, device))
        fut.result(timeout=120)
        seconds = time.perf_counter() - t0
    finally:
        rig.arena.allocator.unlock(host)
    rig.arena.allocator.touch(host)
    return {"blocks": len(host), "bytes": fut.nbytes, "seconds": seconds, "device_blocks": device}


def request_two_reuse(rig: Rig, tokens: torch.Tensor, first_device_block: int) -> dict[str, Any]:
    """TTFT with reuse: lookup + h2d + rebuild the cache from the pool + run the suffix only."""
    t0 = time.perf_counter()
    loaded = load_prefix(rig, tokens, first_device_block)
    cache = None
    if loaded["blocks"]:
        layers = rig.paged.gather(loaded["device_blocks"])
        cache = rig.model.cache_from_layers(layers)
    reused = loaded["blocks"] * rig.paged.block_size
    logits, _ = rig.model.forward(tokens[reused:], cache)
    ttft = time.perf_counter() - t0
    return {**loaded, "ttft_s": ttft, "logits": logits, "reused_tokens": reused}


def request_two_full(rig: Rig, tokens: torch.Tensor) -> dict[str, Any]:
    """TTFT without reuse: recompute request 2's whole prompt."""
    t0 = time.perf_counter()
    logits, cache = rig.model.forward(tokens)
    return {"ttft_s": time.perf_counter() - t0, "logits": logits, "layers": cache_layers(cache)}


def _reuse_from_scratch(rig: Rig, tokens: torch.Tensor, first_device_block: int) -> dict[str, Any]:
    """Wipe the pool (what request 2 finds must come from the host tier), then reuse."""
    rig.paged.wipe()
    return request_two_reuse(rig, tokens, first_device_block)


def kv_matches(rig: Rig, loaded: dict[str, Any], reference: list) -> bool:
    """Do the h2d'd device blocks hold request 1's KV byte for byte?"""
    if not loaded["blocks"]:
        return True
    n = loaded["blocks"] * rig.paged.block_size
    got = rig.paged.gather(loaded["device_blocks"])
    return all(torch.equal(g[0], r[0][:, :, :n]) and torch.equal(g[1], r[1][:, :, :n])
               for g, r in zip(got, reference))


def run_demo(s: Settings) -> dict[str, Any]:
    """Run the scenario and return the result dict (see :func:`summarize`)."""
    rig = build_rig(s)
    try:
        first, second = make_prompts(s, rig.model.config.vocab_size)
        rig.model.forward(first[: min(64, len(first))])  # warm-up: first calls pay one-off costs
        one = request_one(rig, first)
        full = min((request_two_full(rig, second) for _ in range(s.repeats)), key=lambda r: r["ttft_s"])
        reuse = min((_reuse_from_scratch(rig, second, len(one["device_blocks"])) for _ in range(s.repeats)),
                    key=lambda r: r["ttft_s"])
        exact = kv_matches(rig, reuse, one["layers"])
        return summarize(rig, one, full, reuse, exact)
    finally:
        rig.close()


def _span(blocks: list[int]) -> list[int]:
    """``[first, last]`` of a block range, ``[]`` when empty."""
    return [blocks[0], blocks[-1]] if blocks else []


def _gbps(nbytes: int, seconds: float) -> float | None:
    return nbytes / seconds / 1e9 if seconds > 0 else None


def summarize(rig: Rig, one: dict, full: dict, reuse: dict, kv_exact: bool) -> dict[str, Any]:
    """The JSON-able result: sizes, timings, bandwidths and the correctness check."""
    s, a, b = rig.settings, full["logits"], reuse["logits"]
    close = bool(torch.allclose(a, b, atol=ATOL, rtol=RTOL))
    same_argmax = int(a.argmax()) == int(b.argmax())
    return {
        "model": {"layers": rig.model.geometry.num_layers, "kv_heads": rig.model.geometry.kv_heads,
                  "head_dim": rig.model.geometry.head_dim, "params": rig.model.num_params,
                  "dtype": "float32"},
        "prompt_tokens": s.prompt_tokens, "shared_tokens": s.shared_tokens, "block_size": s.block_size,
        "repeats": s.repeats, "block_bytes": rig.paged.block_nbytes,
        "blocks_offloaded": one["blocks"], "d2h_bytes": one["bytes"], "d2h_s": one["seconds"],
        "d2h_gbps": _gbps(one["bytes"], one["seconds"]),
        "blocks_reused": reuse["blocks"], "reused_tokens": reuse["reused_tokens"],
        "suffix_tokens": s.prompt_tokens - reuse["reused_tokens"],
        "device_blocks": {"request1": _span(one["device_blocks"]), "request2": _span(reuse["device_blocks"])},
        "h2d_bytes": reuse["bytes"], "h2d_s": reuse["seconds"], "h2d_gbps": _gbps(reuse["bytes"], reuse["seconds"]),
        "prefill1_s": one["prefill_s"], "ttft_no_reuse_s": full["ttft_s"], "ttft_reuse_s": reuse["ttft_s"],
        "speedup": full["ttft_s"] / reuse["ttft_s"] if reuse["ttft_s"] > 0 else None,
        "logits_max_abs_diff": float((a - b).abs().max()), "atol": ATOL, "rtol": RTOL,
        "logits_allclose": close, "argmax_match": same_argmax, "kv_bytes_exact": kv_exact,
        "passed": close and same_argmax and kv_exact,
    }
