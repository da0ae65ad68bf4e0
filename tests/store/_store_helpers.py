"""Helpers of the store tests: a small CPU layout, identities and keys."""

from __future__ import annotations

import numpy as np

from tiersync.layout.adapters import kv_layout
from tiersync.store import CacheIdentity, block_keys

BLOCK_TOKENS = 4


def make_layout(num_blocks: int = 16, nbytes: int = 256):
    dev = np.zeros((num_blocks, nbytes), dtype=np.uint8)
    return dev, kv_layout([dev])


def identity(layout=None, version: str = "v1") -> CacheIdentity:
    return CacheIdentity("tiny", version, "uint8", BLOCK_TOKENS, layout.digest() if layout else b"")


def keys_for(n: int, seed: int = 0, ident: CacheIdentity | None = None) -> list[bytes]:
    ident = ident or identity()
    return block_keys([seed * 100000 + i for i in range(n * BLOCK_TOKENS)], ident)
