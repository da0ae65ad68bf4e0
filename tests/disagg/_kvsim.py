"""Simulated ranks for the disagg tests: global KV <-> per-rank paged layer buffers (numpy)."""

from __future__ import annotations

import numpy as np

from tiersync.disagg.geometry import KVOrder, PagedKVLayout


def global_kv(layout: PagedKVLayout, num_tokens: int, seed: int = 0) -> np.ndarray:
    """Random bytes shaped [layers, 2, tokens, heads, head_nbytes] (uint8)."""
    rng = np.random.default_rng(seed)
    shape = (layout.num_layers, 2, num_tokens, layout.num_kv_heads, layout.head_nbytes)
    return rng.integers(0, 256, size=shape, dtype=np.uint8)


def _rank_view(buf: np.ndarray, layout: PagedKVLayout) -> np.ndarray:
    """[2, num_blocks, block_size, local_heads, head_nbytes] view of one layer buffer."""
    shape = layout.shape[:-1] + (layout.head_nbytes,)
    v = buf.reshape(shape)
    if layout.order is KVOrder.HEAD_MAJOR:  # [num_blocks, heads, block_size, 2, head]
        return v.transpose(3, 0, 2, 1, 4)
    return v if layout.order is KVOrder.KV_MAJOR else v.transpose(1, 0, 2, 3, 4)


def shard(layout: PagedKVLayout, kv: np.ndarray, block_ids, fill: int = 0) -> list[list[np.ndarray]]:
    """Per rank, per layer, a flat uint8 buffer holding ``kv``'s tokens at ``block_ids``."""
    ranks = []
    num_tokens = kv.shape[2]
    t = np.arange(num_tokens)
    blocks, slots = np.asarray(block_ids)[t // layout.block_size], t % layout.block_size
    for r in range(layout.tp_size):
        first, count = layout.heads_of(r)
        layers = []
        for layer in range(layout.num_layers):
            buf = np.full(layout.layer_nbytes, fill, dtype=np.uint8)
            _rank_view(buf, layout)[:, blocks, slots] = kv[layer, :, :, first : first + count]
            layers.append(buf)
        ranks.append(layers)
    return ranks


def unshard(layout: PagedKVLayout, ranks, block_ids, num_tokens: int) -> np.ndarray:
    """Inverse of :func:`shard`: global [layers, 2, tokens, heads, head_nbytes] from rank buffers."""
    out = np.zeros((layout.num_layers, 2, num_tokens, layout.num_kv_heads, layout.head_nbytes), np.uint8)
    t = np.arange(num_tokens)
    blocks, slots = np.asarray(block_ids)[t // layout.block_size], t % layout.block_size
    for r in range(layout.tp_size):
        first, count = layout.heads_of(r)
        for layer in range(layout.num_layers):
            out[layer, :, :, first : first + count] = _rank_view(np.asarray(ranks[r][layer]).reshape(-1), layout)[
                :, blocks, slots
            ]
    return out


def expected_mask(layout: PagedKVLayout, block_ids, num_tokens: int) -> np.ndarray:
    """1 for every byte of one layer buffer that holds one of the request's tokens, else 0."""
    mask = np.zeros(layout.layer_nbytes, dtype=np.uint8)
    t = np.arange(num_tokens)
    blocks, slots = np.asarray(block_ids)[t // layout.block_size], t % layout.block_size
    _rank_view(mask, layout)[:, blocks, slots] = 1
    return mask
