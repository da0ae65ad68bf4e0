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

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

from tiersync.demo.model import TinyModel, cache_layers, load_config
from tiersync.demo.paged import PagedKV
from tiersync.store import CacheIdentity, KVCacheStore, Residency, StoreConfig, block_keys
from tiersync.tiers.storage import StorageConfig, StorageTier

ATOL, RTOL = 1e-4, 1e-5
MODEL_NAME = "tiersync-demo/tiny-llama"
TIMEOUT_S = 120


@dataclass(frozen=True)
class Settings:
    """One demo run. ``shared_tokens`` of the two prompts are equal; the rest differ."""

    prompt_tokens: int = 4096
    shared_tokens: int = 3800
    block_size: int = 16
    seed: int = 0
    repeats: int = 1  # TTFT and loads are timed this many times; the fastest run is reported
    inject_fault: bool = False  # corrupt one host block: the check must then FAIL
    storage_dir: str | None = None  # None: a temporary directory, removed at the end
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
    """Everything one run holds: model, device pool, the store (host + disk) and its identity."""

    settings: Settings
    model: TinyModel
    paged: PagedKV
    identity: CacheIdentity
    storage_dir: str
    own_dir: bool
    host_blocks: int
    store: KVCacheStore | None = None
    cleared_blocks: int = 0

    def open_store(self) -> float:
        """Open a store with an empty host tier on ``storage_dir``; seconds it took (scan + prefault)."""
        t0 = time.perf_counter()
        storage = StorageTier(StorageConfig(self.storage_dir, self.identity.digest(), workers=2))
        # Watermarks: no demotion while >= 1 host block is free; once none is, demote every idle entry.
        # One batch for all of them: a demotion stops after its first batch once the free count is
        # back over the low watermark, whatever high_watermark says (see the store's demotion loop).
        n = self.host_blocks
        cfg = StoreConfig(host_blocks=n, low_watermark=0.5 / n, high_watermark=1.0, demote_batch=n)
        self.store = KVCacheStore(self.paged.layout, cfg, storage=storage)
        self.store.arena.memory[:] = 0  # fault the pages in now, as a server does at start-up
        return time.perf_counter() - t0

    def close_store(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None

    def close(self) -> None:
        self.close_store()
        if self.own_dir:
            shutil.rmtree(self.storage_dir, ignore_errors=True)


def cache_identity(s: Settings, paged: PagedKV) -> CacheIdentity:
    """Model name + weights version (seed and config overrides) + dtype, block size, layout."""
    overrides = json.dumps(s.model_overrides, sort_keys=True, default=str).encode()
    version = f"random-seed{s.seed}-{xxhash.xxh3_64_hexdigest(overrides)}"
    return CacheIdentity(MODEL_NAME, version, "float32", s.block_size, layout_digest=paged.layout.digest())


def build_rig(s: Settings) -> Rig:
    """Model, a pool with room for both requests side by side, a store with room for both requests' blocks."""
    model = TinyModel(load_config(s.model_overrides), seed=s.seed)
    per_request = -(-s.prompt_tokens // s.block_size)
    paged = PagedKV(model.geometry, 2 * per_request, s.block_size)
    own = s.storage_dir is None
    directory = tempfile.mkdtemp(prefix="tiersync-demo-") if own else os.path.abspath(s.storage_dir)
    full_blocks = s.prompt_tokens // s.block_size
    new_in_two = full_blocks - s.shared_tokens // s.block_size  # request 2's full blocks not in request 1
    rig = Rig(s, model, paged, cache_identity(s, paged), directory, own,
              host_blocks=full_blocks + max(new_in_two, 1))
    try:
        rig.open_store()
        stale = rig.store.storage.keys()
        if stale:  # a given directory with blocks of this identity from an earlier run: start clean
            rig.store.close()
            with StorageTier(StorageConfig(directory, rig.identity.digest(), workers=1)) as st:
                st.delete(stale)
            rig.cleared_blocks = len(stale)
            rig.open_store()
    except BaseException:
        rig.close()
        raise
    return rig


def make_prompts(s: Settings, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of ``prompt_tokens`` random ids sharing the first ``shared_tokens``."""
    gen = torch.Generator().manual_seed(s.seed + 1)
    first = torch.randint(0, vocab, (s.prompt_tokens,), generator=gen)
    second = first.clone()
    tail = second[s.shared_tokens:]
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
    return {"blocks": len(res.saved), "skipped": len(res.skipped), "bytes": len(res.saved) * rig.paged.block_nbytes,
            "seconds": seconds, "keys": keys}


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
    return {"blocks": hit.num_hits, "bytes": hit.num_hits * rig.paged.block_nbytes, "seconds": seconds,
            "device_blocks": device, "hit": tiers}


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
    return {"saved_blocks": saved["blocks"], "layers": layers, "drained": drained, "seconds": seconds, "bytes": written,
            "blocks": written // store.arena.block_nbytes if store.arena.block_nbytes else 0,
            "host_entries": st.host_entries, "storage_entries": st.storage_entries, "request2_on_disk": on_disk}


def serve_after_restart(rig: Rig, tokens: torch.Tensor, first_device_block: int) -> dict[str, Any]:
    """Close the store, open a NEW one on the same directory (empty host tier), serve ``tokens``."""
    rig.close_store()
    open_s = rig.open_store()
    storage = rig.store.storage
    found = storage.num_blocks
    read0 = storage.stats().bytes_read
    out = _reuse_from_scratch(rig, tokens, first_device_block)
    return {**out, "open_s": open_s, "storage_blocks_found": found,
            "disk_bytes": storage.stats().bytes_read - read0}


def kv_matches(rig: Rig, loaded: dict[str, Any], reference: list) -> bool:
    """Do the loaded device blocks hold the ``reference`` KV (as it was saved) byte for byte?"""
    if not loaded["blocks"]:
        return True
    n = loaded["blocks"] * rig.paged.block_size
    got = rig.paged.gather(loaded["device_blocks"])
    return all(torch.equal(g[0], r[0][:, :, :n]) and torch.equal(g[1], r[1][:, :, :n])
               for g, r in zip(got, reference))


def _fastest(runs) -> dict[str, Any]:
    return min(runs, key=lambda r: r["ttft_s"])


def run_demo(s: Settings) -> dict[str, Any]:
    """Run the scenario and return the result dict (see :func:`summarize`)."""
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


def _span(blocks: list[int]) -> list[int]:
    """``[first, last]`` of a block range, ``[]`` when empty."""
    return [blocks[0], blocks[-1]] if blocks else []


def _gbps(nbytes: int, seconds: float) -> float | None:
    return nbytes / seconds / 1e9 if seconds > 0 else None


def _logits_check(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    return {"logits_max_abs_diff": float((a - b).abs().max()),
            "logits_allclose": bool(torch.allclose(a, b, atol=ATOL, rtol=RTOL)),
            "argmax_match": int(a.argmax()) == int(b.argmax())}


def summarize(rig: Rig, one: dict, full: dict, reuse: dict, kv_exact: bool, demote: dict,
              restart: dict | None) -> dict[str, Any]:
    """The JSON-able result: sizes, timings, bandwidths and the correctness checks."""
    s = rig.settings
    check = _logits_check(full["logits"], reuse["logits"])
    host_only = reuse["hit"]["storage"] == 0
    phase2_ok = check["logits_allclose"] and check["argmax_match"] and kv_exact and host_only
    disk = {"storage_dir": rig.storage_dir, "storage_dir_kept": not rig.own_dir,
            "cleared_stale_blocks": rig.cleared_blocks,
            "demote": {"request2_blocks_saved": demote["saved_blocks"], "blocks": demote["blocks"],
                       "bytes": demote["bytes"], "seconds": demote["seconds"],
                       "gbps": _gbps(demote["bytes"], demote["seconds"]), "drained": demote["drained"],
                       "host_entries_after": demote["host_entries"],
                       "storage_entries_after": demote["storage_entries"]}}
    if restart is None:
        disk["restart"] = {"skipped": "request 2 has no full block of its own, so nothing filled the host tier",
                           "passed": True}
    else:
        rc = _logits_check(full["logits"], restart["logits"])
        expected = (s.prompt_tokens - 1) // s.block_size  # every block of request 2 left before its last token
        hit_disk = restart["hit"]["storage"] == expected and restart["hit"]["host"] == 0 and restart["blocks"] == expected
        disk["restart"] = {
            "open_s": restart["open_s"], "storage_blocks_found": restart["storage_blocks_found"],
            "blocks_hit": restart["hit"], "expected_blocks": expected, "blocks_reused": restart["blocks"],
            "reused_tokens": restart["reused_tokens"], "suffix_tokens": s.prompt_tokens - restart["reused_tokens"],
            "disk_bytes": restart["disk_bytes"], "h2d_bytes": restart["bytes"],
            "load_s": restart["seconds"], "load_gbps": _gbps(restart["bytes"], restart["seconds"]),
            "ttft_s": restart["ttft_s"],
            "speedup": full["ttft_s"] / restart["ttft_s"] if restart["ttft_s"] > 0 else None,
            **rc, "kv_bytes_exact": restart["kv_exact"], "hit_on_disk": hit_disk,
            "passed": rc["logits_allclose"] and rc["argmax_match"] and restart["kv_exact"] and hit_disk,
        }
    return {
        "model": {"name": rig.identity.model, "weights_version": rig.identity.weights_version,
                  "layers": rig.model.geometry.num_layers, "kv_heads": rig.model.geometry.kv_heads,
                  "head_dim": rig.model.geometry.head_dim, "params": rig.model.num_params,
                  "dtype": "float32"},
        "prompt_tokens": s.prompt_tokens, "shared_tokens": s.shared_tokens, "block_size": s.block_size,
        "repeats": s.repeats, "block_bytes": rig.paged.block_nbytes, "host_blocks": rig.host_blocks,
        "blocks_offloaded": one["blocks"], "d2h_bytes": one["bytes"], "d2h_s": one["seconds"],
        "d2h_gbps": _gbps(one["bytes"], one["seconds"]),
        "blocks_reused": reuse["blocks"], "blocks_hit": reuse["hit"], "reused_tokens": reuse["reused_tokens"],
        "suffix_tokens": s.prompt_tokens - reuse["reused_tokens"],
        "device_blocks": {"request1": _span(one["device_blocks"]), "request2": _span(reuse["device_blocks"])},
        "h2d_bytes": reuse["bytes"], "h2d_s": reuse["seconds"], "h2d_gbps": _gbps(reuse["bytes"], reuse["seconds"]),
        "prefill1_s": one["prefill_s"], "ttft_no_reuse_s": full["ttft_s"], "ttft_reuse_s": reuse["ttft_s"],
        "speedup": full["ttft_s"] / reuse["ttft_s"] if reuse["ttft_s"] > 0 else None,
        **check, "atol": ATOL, "rtol": RTOL, "kv_bytes_exact": kv_exact, "host_phase_passed": phase2_ok,
        **disk,
        "passed": phase2_ok and disk["restart"]["passed"],
    }
