"""Test pools with known bytes: a tensor view plus a uint8 alias of its whole storage.

Every storage byte the view does not cover (padding) holds SENTINEL, so a test
can prove padding is never read into the host image nor written on h2d.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

SENTINEL = 0xA5
HOST_SENTINEL = 0x5A


@dataclass
class SeededPool:
    tensor: Any  # what is handed to kv_layout (view into the storage)
    u8: np.ndarray  # flat uint8 alias of the whole storage
    live: np.ndarray  # bool mask over u8: bytes that belong to the pool
    blocks: np.ndarray  # (num_blocks, block_live_bytes) fancy index of live bytes, C order

    def block(self, b: int) -> bytes:
        """Logical (C-order) bytes of block ``b``: what its host image must hold."""
        return self.u8[self.blocks[b]].tobytes()

    def snapshot(self) -> bytes:
        return self.u8.tobytes()

    def scramble(self, rng: np.random.Generator) -> None:
        self.u8[self.live] = rng.integers(0, 256, int(self.live.sum()), dtype=np.uint8)


def make_pool(
    lib: str,
    dtype: Any,
    rng: np.random.Generator,
    *,
    num_blocks: int = 16,
    heads: int = 2,
    dim: int = 24,
    pad: int = 8,
    lead: int = 1,
) -> SeededPool:
    """Storage ``(lead + num_blocks, heads, dim + pad)``; the pool is ``[lead:, :, :dim]``."""
    shape = (lead + num_blocks, heads, dim + pad)
    if lib == "numpy":
        buf = np.empty(shape, dtype=dtype)
        u8 = buf.view(np.uint8).reshape(-1)
        item = buf.itemsize
    elif lib == "torch":
        import torch

        buf = torch.empty(shape, dtype=dtype)
        u8 = buf.view(torch.uint8).numpy().reshape(-1)
        item = buf.element_size()
    else:
        raise ValueError(lib)
    idx = np.arange(u8.size).reshape(shape[0], heads, (dim + pad) * item)[lead:, :, : dim * item]
    live = np.zeros(u8.size, dtype=bool)
    live[idx.reshape(-1)] = True
    u8[:] = SENTINEL
    pool = SeededPool(buf[lead:, :, :dim], u8, live, idx.reshape(num_blocks, -1))
    pool.scramble(rng)
    return pool


def host_segment(arena: Any, layout: Any, pool_index: int, host_block: int) -> bytes:
    off = layout.host_offsets[pool_index]
    n = layout.pools[pool_index].spec.block_nbytes
    return arena.memory[host_block, off : off + n].tobytes()


def host_live_mask(arena: Any, layout: Any) -> np.ndarray:
    """Per host block: which bytes are some pool's live segment."""
    m = np.zeros(arena.block_nbytes, dtype=bool)
    for off, p in zip(layout.host_offsets, layout.pools):
        m[off : off + p.spec.block_nbytes] = True
    return m
