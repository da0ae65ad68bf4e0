"""Geometry of one rank's paged KV cache: which bytes hold which (layer, kv, token, head, dim).

A :class:`PagedKVLayout` describes the per-layer KV tensor of every rank of one tensor-parallel
group (all ranks share the geometry; they differ only in which KV heads they hold). Two orders
are supported, the two vLLM uses:

- :attr:`KVOrder.KV_MAJOR`: per layer ``[2, num_blocks, block_size, local_heads, head_dim]``
  (K of every block, then V of every block);
- :attr:`KVOrder.BLOCK_MAJOR`: per layer ``[num_blocks, 2, block_size, local_heads, head_dim]``
  (K and V of block 0, then of block 1, ...);
- :attr:`KVOrder.HEAD_MAJOR`: per layer ``[num_blocks, local_heads, block_size, 2, head_dim]``,
  vLLM's CPU backend (``[num_blocks, heads, block_size, 2 * head_dim]``: K then V per token).

Head ownership: with ``num_kv_heads >= tp_size`` rank ``r`` holds heads
``[r*H/tp, (r+1)*H/tp)``; with ``num_kv_heads < tp_size`` every rank holds one head,
``r // (tp/H)`` (replicated ``tp/H`` times), as vLLM does.

Offsets are bytes from the start of one layer's tensor storage (C-contiguous); every layer has
the same geometry, so offsets are the same for every layer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import cast

import numpy as np
import numpy.typing as npt

from tiersync.errors import UsageError, check_positive_int
from tiersync.layout.pool import PoolSpec, Region

__all__ = ["KVOrder", "PagedKVLayout", "dtype_info"]


# ML dtypes numpy does not know, by name (torch / ml_dtypes spellings).
_EXTRA_DTYPES = {"bfloat16": 2, "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1}


def dtype_info(dtype: object) -> tuple[str, int]:
    """``(name, itemsize)`` of a numpy dtype, a dtype name, or a torch/JAX dtype (by its name;
    ``torch.bfloat16`` -> ``"bfloat16"``). Raises UsageError (argument ``dtype``) when unknown."""
    if dtype is None:
        raise UsageError("a dtype is required", argument="dtype")
    name = (dtype if isinstance(dtype, str) else str(dtype)).rsplit(".", 1)[-1]
    if name in _EXTRA_DTYPES:
        return name, _EXTRA_DTYPES[name]
    dt = None
    for candidate in (name,) if isinstance(dtype, str) else (dtype, name):
        try:
            dt = np.dtype(cast("npt.DTypeLike", candidate))  # a probe: TypeError for what numpy does not know
            break
        except TypeError:
            continue
    if dt is None or dt.kind in "OUSVM" or dt.itemsize == 0:
        raise UsageError("unknown or variable-size dtype", argument="dtype", dtype=dtype)
    return dt.name, dt.itemsize


MAX_FIELD = 1 << 31  # bound of each count and size of a layout
MAX_LAYER_BYTES = 1 << 50  # bound of one layer's bytes on one rank


class KVOrder(enum.Enum):
    """Dimension order of one layer's KV tensor."""

    KV_MAJOR = "kv_major"  # [2, num_blocks, block_size, heads, head_dim]
    BLOCK_MAJOR = "block_major"  # [num_blocks, 2, block_size, heads, head_dim]
    HEAD_MAJOR = "head_major"  # [num_blocks, heads, block_size, 2, head_dim] (vLLM's CPU backend)


@dataclass(frozen=True, slots=True)
class PagedKVLayout:
    """Per-layer KV tensor geometry of every rank of one TP group (frozen, hashable, validated).

    ``num_kv_heads`` is the model's *global* KV head count; ``num_blocks`` the blocks of the
    per-layer buffer a rank hands to tiersync (the whole device cache mirrored on the host, or a
    staging buffer of only a request's blocks: block ids index into it). ``dtype`` is normalised
    to its name (numpy names plus ``bfloat16`` / ``float8_*``). Raises :class:`UsageError`
    naming the field (``num_kv_heads`` when the heads cannot be split over ``tp_size``).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    dtype: str = "float16"
    tp_size: int = 1
    order: KVOrder = KVOrder.KV_MAJOR

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks", "tp_size"):
            check_positive_int(getattr(self, name), name)
            if getattr(self, name) > MAX_FIELD:  # layouts also come off the wire (KV_OPEN)
                raise UsageError(f"must be <= {MAX_FIELD}", argument=name, value=getattr(self, name))
        if not isinstance(self.order, KVOrder):
            try:
                object.__setattr__(self, "order", KVOrder(self.order))
            except ValueError:
                raise UsageError("must be a KVOrder", argument="order", value=self.order) from None
        name, _ = dtype_info(self.dtype)
        object.__setattr__(self, "dtype", name)
        if self.layer_nbytes > MAX_LAYER_BYTES:  # every offset then fits an int64 with room to spare
            raise UsageError(f"one layer would exceed {MAX_LAYER_BYTES} bytes", argument="num_blocks")
        h, tp = self.num_kv_heads, self.tp_size
        if h >= tp and h % tp:
            raise UsageError("must be divisible by tp_size", argument="num_kv_heads", num_kv_heads=h, tp_size=tp)
        if h < tp and tp % h:
            raise UsageError(
                "tp_size must be a multiple of num_kv_heads when heads are replicated",
                argument="num_kv_heads",
                num_kv_heads=h,
                tp_size=tp,
            )

    # -- sizes -------------------------------------------------------------------------------
    @property
    def itemsize(self) -> int:
        return dtype_info(self.dtype)[1]

    @property
    def local_heads(self) -> int:
        """KV heads held by each rank."""
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def head_nbytes(self) -> int:
        """Bytes of one head of one token (``head_dim * itemsize``)."""
        return self.head_dim * self.itemsize

    @property
    def token_nbytes(self) -> int:
        """Bytes of one token's K (or V) on one rank."""
        return self.local_heads * self.head_nbytes

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block's K (or V) on one rank."""
        return self.block_size * self.token_nbytes

    @property
    def layer_nbytes(self) -> int:
        """Bytes of one layer's tensor on one rank (K and V of every block)."""
        return 2 * self.num_blocks * self.block_nbytes

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of one layer's tensor on one rank."""
        tail = (self.block_size, self.local_heads, self.head_dim)
        if self.order is KVOrder.HEAD_MAJOR:
            return (self.num_blocks, self.local_heads, self.block_size, 2, self.head_dim)
        if self.order is KVOrder.KV_MAJOR:
            return (2, self.num_blocks) + tail
        return (self.num_blocks, 2) + tail

    # -- addressing --------------------------------------------------------------------------
    def block_stride(self) -> int:
        """Bytes between block ``i`` and ``i+1`` of the same K (or V) pool."""
        return self.block_nbytes if self.order is KVOrder.KV_MAJOR else 2 * self.block_nbytes

    def kv_base(self, kv: int) -> int:
        """Offset of block 0 of K (``kv=0``) or V (``kv=1``)."""
        if self.order is KVOrder.KV_MAJOR:
            return kv * self.num_blocks * self.block_nbytes
        if self.order is KVOrder.HEAD_MAJOR:
            return kv * self.head_nbytes
        return kv * self.block_nbytes

    def token_stride(self) -> int:
        """Bytes between slot ``s`` and ``s+1`` of one block's K (or V) of the same head."""
        return 2 * self.head_nbytes if self.order is KVOrder.HEAD_MAJOR else self.token_nbytes

    def head_stride(self) -> int:
        """Bytes between local head ``h`` and ``h+1`` of one token's K (or V); equal to
        :attr:`head_nbytes` when a token's heads are contiguous."""
        return 2 * self.block_size * self.head_nbytes if self.order is KVOrder.HEAD_MAJOR else self.head_nbytes

    def offset(self, kv: int, block: int, slot: int, local_head: int = 0) -> int:
        """Byte offset of (kv, block, slot-in-block, local head, dim 0) inside a layer tensor."""
        return (
            self.kv_base(kv)
            + block * self.block_stride()
            + slot * self.token_stride()
            + local_head * self.head_stride()
        )

    def heads_of(self, rank: int) -> tuple[int, int]:
        """``(first_global_head, count)`` held by ``rank``. Raises UsageError for a bad rank."""
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.tp_size:
            raise UsageError("must be in [0, tp_size)", argument="rank", value=rank, tp_size=self.tp_size)
        if self.num_kv_heads >= self.tp_size:
            return rank * self.local_heads, self.local_heads
        return rank // (self.tp_size // self.num_kv_heads), 1

    def pool_specs(self) -> tuple[PoolSpec, PoolSpec]:
        """The K and V pools (tags ``"k"``, ``"v"``) of one layer tensor, as :mod:`tiersync.layout`
        specs: ``num_blocks`` blocks sharing the layer's storage (one region each; one region
        per (head, slot) in :attr:`KVOrder.HEAD_MAJOR`)."""
        if self.order is KVOrder.HEAD_MAJOR:
            regions = tuple(
                Region(h * self.head_stride() + s * self.token_stride(), self.head_nbytes)
                for h in range(self.local_heads)
                for s in range(self.block_size)
            )
        else:
            regions = (Region(0, self.block_nbytes),)
        k, v = (
            PoolSpec(
                num_blocks=self.num_blocks,
                block_stride=self.block_stride(),
                regions=regions,
                base_offset=self.kv_base(kv),
                tag="kv"[kv],
                dtype=self.dtype,
            )
            for kv in (0, 1)
        )
        return k, v

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that ``num_tokens`` tokens occupy."""
        return -(-num_tokens // self.block_size)

    # -- wire form ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, object]:
        """JSON-able form (for kv_transfer_params and the wire); inverse of :meth:`from_dict`."""
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "dtype": self.dtype,
            "tp_size": self.tp_size,
            "order": self.order.value,
        }

    @classmethod
    def from_dict(cls, data: object, argument: str = "layout") -> PagedKVLayout:
        """Rebuild from :meth:`to_dict`'s output. Raises UsageError naming ``argument`` when malformed."""
        if not isinstance(data, dict) or set(data) != set(cls.__dataclass_fields__):
            raise UsageError("malformed layout description", argument=argument)
        try:
            return cls(**data)
        except UsageError as exc:
            raise UsageError(f"invalid layout: {exc.message}", argument=argument) from None
