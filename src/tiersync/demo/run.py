"""The demo scenario: prefix reuse of a KV cache through host DRAM and disk.

Keys are :func:`tiersync.store.keys.block_keys` under a :class:`CacheIdentity`
naming the model and its weights version; every copy goes through a real
:class:`~tiersync.store.KVCacheStore` with a :class:`StorageTier` in a directory.

1. Request 1 prefills a long prompt; its KV is scattered into a paged pool
   (the "device") and its full blocks are saved (d2h) to the host tier.
2. Request 2 shares the first ``shared_tokens`` tokens. The pool is wiped, the
   longest prefix found (on the host) is loaded (h2d) into *other* device
   blocks, a cache is rebuilt from them and only the suffix is run. Its
   logits must match a full recompute of request 2's prompt.
3. Request 2's own KV is saved as a server would; that fills the host tier
   past its low watermark and the store demotes every idle entry to disk.
4. Restart: the store is closed and a NEW one opened on the same directory
   with an empty host tier. Request 2 is served again: all its full blocks
   before its last token (request 1's shared ones and its own) must hit on
   disk (promoted to host, then h2d), byte-exact, and its logits must match
   the full recompute again.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from tiersync.demo.model import cache_layers
from tiersync.demo.rig import MODEL_NAME, Rig, Settings, build_rig, cache_identity
from tiersync.demo.summary import ATOL, RTOL, summarize
from tiersync.store import Residency, block_keys

# MODEL_NAME, Settings, Rig, build_rig, cache_identity (tiersync.demo.rig), ATOL, RTOL and
# summarize (tiersync.demo.summary) were defined here once: still importable from this module
__all__ = [
    "ATOL",
    "MODEL_NAME",
    "RTOL",
    "TIMEOUT_S",
    "Rig",
    "Settings",
    "build_rig",
    "cache_identity",
    "keys_of",
    "kv_matches",
    "load_prefix",
    "make_prompts",
    "request_one",
    "request_two_full",
    "request_two_reuse",
    "run_demo",
    "save_and_demote",
    "save_blocks",
    "serve_after_restart",
    "summarize",
]

TIMEOUT_S = 120


def make_prompts(s: Settings, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of ``prompt_tokens`` random ids sharing the first ``shared_tokens``."""
    gen = torch.Generator().manual_seed(s.seed + 1)
    first = torch.randint(0, vocab, (s.prompt_tokens,), generator=gen)
    second = first.clone()
    tail = second[s.shared_tokens :]
    tail.copy_((tail + 1 + torch.randint(0, vocab - 1, tail.shape, generator=gen)) % vocab)  # differs everywhere
    return first, second


def keys_of(rig: Rig, tokens: torch.Tensor) -> list[bytes]:
    """Prefix keys of the full blocks of ``tokens`` (the store's own key scheme)."""
    return block_keys(tokens.numpy(), rig.identity)


def save_blocks(rig: Rig, tokens: torch.Tensor, device_blocks: list[int]) -> dict[str, Any]:
    """Save (d2h) the full blocks of ``tokens`` held in ``device_blocks`` to the host tier."""
    keys = keys_of(rig, tokens)
    t0 = time.perf_counter()
    res = rig.store.save(device_blocks[: len(keys)], keys).result(TIMEOUT_S)
    seconds = time.perf_counter() - t0
    return {
        "blocks": len(res.saved),
        "skipped": len(res.skipped),
        "bytes": len(res.saved) * rig.paged.block_nbytes,
        "seconds": seconds,
        "keys": keys,
    }


def _corrupt_host_block(rig: Rig, key: bytes) -> None:
    arena = rig.store.arena
    block = next(b for b in range(arena.num_blocks) if arena.key_of(b) == key)
    arena.memory[block].view(np.float32)[:] += 1.0


def request_one(rig: Rig, tokens: torch.Tensor) -> dict[str, Any]:
    """Prefill request 1, page its KV into blocks 0.., save the full blocks to the host tier."""
    t0 = time.perf_counter()
    _, cache = rig.model.forward(tokens)
    prefill_s = time.perf_counter() - t0
    layers = cache_layers(cache)
    device_blocks = list(range(-(-len(tokens) // rig.paged.block_size)))
    rig.paged.scatter(layers, device_blocks)
    out = save_blocks(rig, tokens, device_blocks)
    if rig.settings.inject_fault and out["keys"]:
        _corrupt_host_block(rig, out["keys"][0])
    return {**out, "prefill_s": prefill_s, "device_blocks": device_blocks, "layers": layers}


def load_prefix(rig: Rig, tokens: torch.Tensor, first_device_block: int) -> dict[str, Any]:
    """Look up the longest stored prefix of ``tokens`` (leaving >= 1 token to run) and load it."""
    bs = rig.paged.block_size
    keys = keys_of(rig, tokens)[: (len(tokens) - 1) // bs]
    hit = rig.store.lookup(keys)  # pins every key it returns
    on_host = sum(1 for r in hit.residency if r & Residency.HOST)
    tiers = {"host": on_host, "storage": hit.num_hits - on_host}
    if not hit.num_hits:
        return {"blocks": 0, "bytes": 0, "seconds": 0.0, "device_blocks": [], "hit": tiers}
    device = list(range(first_device_block, first_device_block + hit.num_hits))
    t0 = time.perf_counter()
    try:
        rig.store.load(hit.keys, device).result(TIMEOUT_S)  # storage -> host (if cold) -> device
    except BaseException:
        rig.store.release(hit.keys)  # a failed load keeps the pins
        raise
    seconds = time.perf_counter() - t0
    return {
        "blocks": hit.num_hits,
        "bytes": hit.num_hits * rig.paged.block_nbytes,
        "seconds": seconds,
        "device_blocks": device,
        "hit": tiers,
    }


def request_two_reuse(rig: Rig, tokens: torch.Tensor, first_device_block: int) -> dict[str, Any]:
    """TTFT with reuse: lookup + load + rebuild the cache from the pool + run the suffix only."""
    t0 = time.perf_counter()
    loaded = load_prefix(rig, tokens, first_device_block)
    cache = None
    if loaded["blocks"]:
        layers = rig.paged.gather(loaded["device_blocks"])
        cache = rig.model.cache_from_layers(layers)
    reused = loaded["blocks"] * rig.paged.block_size
    logits, grown = rig.model.forward(tokens[reused:], cache)
    ttft = time.perf_counter() - t0
    return {**loaded, "ttft_s": ttft, "logits": logits, "reused_tokens": reused, "cache": grown}


def request_two_full(rig: Rig, tokens: torch.Tensor) -> dict[str, Any]:
    """TTFT without reuse: recompute request 2's whole prompt."""
    t0 = time.perf_counter()
    logits, cache = rig.model.forward(tokens)
    return {"ttft_s": time.perf_counter() - t0, "logits": logits, "layers": cache_layers(cache)}


def _reuse_from_scratch(rig: Rig, tokens: torch.Tensor, first_device_block: int) -> dict[str, Any]:
    """Wipe the pool (what request 2 finds must come from the store), then reuse."""
    rig.paged.wipe()
    return request_two_reuse(rig, tokens, first_device_block)


def save_and_demote(rig: Rig, tokens: torch.Tensor, reuse: dict[str, Any], first_device_block: int) -> dict[str, Any]:
    """Save request 2's KV (its prefix is already stored); the host tier runs out and demotes to disk."""
    layers = cache_layers(reuse["cache"])
    device_blocks = list(range(first_device_block, first_device_block + -(-len(tokens) // rig.paged.block_size)))
    rig.paged.scatter(layers, device_blocks)
    store, storage = rig.store, rig.store.storage
    written0 = storage.stats().bytes_written
    t0 = time.perf_counter()
    saved = save_blocks(rig, tokens, device_blocks)
    drained = store.wait_demotions(TIMEOUT_S)
    seconds = time.perf_counter() - t0
    written = storage.stats().bytes_written - written0
    st = store.stats()
    on_disk = sum(1 for r in store.residency(saved["keys"]) if r & Residency.STORAGE)
    return {
        "saved_blocks": saved["blocks"],
        "layers": layers,
        "drained": drained,
        "seconds": seconds,
        "bytes": written,
        "blocks": written // store.arena.block_nbytes if store.arena.block_nbytes else 0,
        "host_entries": st.host_entries,
        "storage_entries": st.storage_entries,
        "request2_on_disk": on_disk,
    }


def serve_after_restart(rig: Rig, tokens: torch.Tensor, first_device_block: int) -> dict[str, Any]:
    """Close the store, open a NEW one on the same directory (empty host tier), serve ``tokens``."""
    rig.close_store()
    open_s = rig.open_store()
    storage = rig.store.storage
    found = storage.num_blocks
    read0 = storage.stats().bytes_read
    out = _reuse_from_scratch(rig, tokens, first_device_block)
    return {**out, "open_s": open_s, "storage_blocks_found": found, "disk_bytes": storage.stats().bytes_read - read0}


def kv_matches(rig: Rig, loaded: dict[str, Any], reference: list) -> bool:
    """Do the loaded device blocks hold the ``reference`` KV (as it was saved) byte for byte?"""
    if not loaded["blocks"]:
        return True
    n = loaded["blocks"] * rig.paged.block_size
    got = rig.paged.gather(loaded["device_blocks"])
    return all(torch.equal(g[0], r[0][:, :, :n]) and torch.equal(g[1], r[1][:, :, :n]) for g, r in zip(got, reference))


def _fastest(runs) -> dict[str, Any]:
    return min(runs, key=lambda r: r["ttft_s"])


def run_demo(s: Settings) -> dict[str, Any]:
    """Run the scenario and return the result dict (see :func:`tiersync.demo.summary.summarize`)."""
    rig = build_rig(s)
    try:
        first, second = make_prompts(s, rig.model.config.vocab_size)
        rig.model.forward(first[: min(64, len(first))])  # warm-up: first calls pay one-off costs
        one = request_one(rig, first)
        two_at = len(one["device_blocks"])
        full = _fastest(request_two_full(rig, second) for _ in range(s.repeats))
        reuse = _fastest(_reuse_from_scratch(rig, second, two_at) for _ in range(s.repeats))
        exact = kv_matches(rig, reuse, one["layers"])
        demote = save_and_demote(rig, second, reuse, two_at)
        restart = None
        if demote["saved_blocks"]:  # else nothing pushed the host tier over its watermark
            restart = _fastest(serve_after_restart(rig, second, two_at) for _ in range(s.repeats))
            restart["kv_exact"] = kv_matches(rig, restart, demote["layers"])  # request 2's KV as saved
        return summarize(rig, one, full, reuse, exact, demote, restart)
    finally:
        rig.close()
