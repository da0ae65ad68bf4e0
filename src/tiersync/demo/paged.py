"""A paged KV pool standing in for device memory.

:class:`PagedKV` holds, per layer, a ``k`` and a ``v`` tensor of shape
``(num_blocks, block_size, kv_heads, head_dim)`` (torch CPU), bound in place
as a :class:`~tiersync.layout.KVLayout`. It scatters a model's contiguous KV
into chosen blocks and gathers blocks back into contiguous KV.

Prefix keys, the host tier and the disk tier are the real
:class:`~tiersync.store.KVCacheStore`'s (see :mod:`tiersync.demo.run`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tiersync.demo.model import KVGeometry
from tiersync.layout import KVLayout, kv_layout

KVLayers = list[tuple[torch.Tensor, torch.Tensor]]


class PagedKV:
    """``num_blocks`` blocks of ``block_size`` tokens per layer, k and v, as one layout."""

    def __init__(self, geometry: KVGeometry, num_blocks: int, block_size: int = 16) -> None:
        self.geometry, self.num_blocks, self.block_size = geometry, num_blocks, block_size
        shape = (num_blocks, block_size, geometry.kv_heads, geometry.head_dim)
        self.pools = [
            (torch.zeros(shape, dtype=geometry.dtype), torch.zeros(shape, dtype=geometry.dtype))
            for _ in range(geometry.num_layers)
        ]
        self.layout: KVLayout = kv_layout(self.pools, tags=["k", "v"])

    @property
    def block_nbytes(self) -> int:
        """Live KV bytes of one block over all layers (what one block transfer moves)."""
        return self.layout.block_nbytes

    def wipe(self) -> None:
        """Zero every block in place (the tensors, and so the layout, stay the same)."""
        for k, v in self.pools:
            k.zero_()
            v.zero_()

    def scatter(self, layers: KVLayers, blocks: Sequence[int]) -> None:
        """Write ``layers`` (seq tokens each) into ``blocks``; the last block may be partial."""
        seq = layers[0][0].shape[-2]
        if len(blocks) * self.block_size < seq:
            raise ValueError(f"{len(blocks)} blocks cannot hold {seq} tokens")
        full, rest = divmod(seq, self.block_size)
        ids = torch.as_tensor(list(blocks[:full]), dtype=torch.long)
        for (pk, pv), (k, v) in zip(self.pools, layers):
            for pool, src in ((pk, k), (pv, v)):
                tokens = src[0].permute(1, 0, 2)  # (seq, kv_heads, head_dim)
                if full:
                    pool[ids] = tokens[: full * self.block_size].reshape(full, self.block_size, *tokens.shape[1:])
                if rest:
                    pool[blocks[full], :rest] = tokens[full * self.block_size :]

    def gather(self, blocks: Sequence[int]) -> KVLayers:
        """Contiguous per-layer ``(k, v)``, (1, kv_heads, len(blocks) * block_size, head_dim)."""
        ids = torch.as_tensor(list(blocks), dtype=torch.long)
        out = []
        for pk, pv in self.pools:
            pair = []
            for pool in (pk, pv):
                picked = pool[ids].reshape(-1, *pool.shape[2:])  # (tokens, kv_heads, head_dim)
                pair.append(picked.permute(1, 0, 2).unsqueeze(0).contiguous())
            out.append((pair[0], pair[1]))
        return out
