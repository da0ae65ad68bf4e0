"""What one demo run holds and how it is set up: :class:`Settings`, :class:`Rig`, :func:`build_rig`.

The rig is the model (a tiny random-weight Llama), a paged device pool with room for both
requests side by side, and a :class:`~tiersync.store.KVCacheStore` whose disk tier is a
:class:`StorageTier` in ``storage_dir``, keyed under a :class:`CacheIdentity` naming the
model and its weights version. The scenario itself is :mod:`tiersync.demo.run`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import xxhash

from tiersync.demo.model import TinyModel, load_config
from tiersync.demo.paged import PagedKV
from tiersync.store import CacheIdentity, KVCacheStore, StoreConfig
from tiersync.tiers.storage import StorageConfig, StorageTier

MODEL_NAME = "tiersync-demo/tiny-llama"


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
    rig = Rig(s, model, paged, cache_identity(s, paged), directory, own, host_blocks=full_blocks + max(new_in_two, 1))
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
