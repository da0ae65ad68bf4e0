"""Pool specifications: where the live bytes of each block sit inside one storage.

A *pool* is ``num_blocks`` equally strided blocks inside one storage. Each block
holds one or more *regions* of live bytes at fixed offsets from the block start;
bytes between regions are padding and are never copied. A pool carries an opaque
``tag`` ("k", "v", "mamba", ...) that tiersync stores and echoes but never parses.

A :class:`KVLayout` is the ordered list of pools of one model shard, each
assigned to a layer. Its host image is block-major: host block ``b`` holds, for
every pool in order, that pool's live bytes of block ``b`` (each pool's segment
starts on a 64-byte boundary), so one host block is one contiguous span that a
file write or a socket send can take whole.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from dataclasses import dataclass, field
from typing import Any

from tiersync.errors import UsageError, check_positive_int

ALIGN = 64


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


class Device(enum.Enum):
    """Where a pool's storage lives. CPU pools are host-addressable."""

    CPU = "cpu"
    CUDA = "cuda"


@dataclass(frozen=True, slots=True)
class Region:
    """``nbytes`` live bytes at ``offset`` bytes from the start of each block."""

    offset: int
    nbytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.offset, int) or isinstance(self.offset, bool) or self.offset < 0:
            raise UsageError("must be a non-negative int", argument="Region.offset", value=self.offset)
        check_positive_int(self.nbytes, "Region.nbytes")

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """Geometry of one pool, independent of any storage.

    Block ``i`` starts at ``base_offset + i * block_stride`` bytes into the
    storage; its live bytes are ``regions`` (sorted, non-overlapping, inside the
    stride). Raises :class:`UsageError` naming the field when inconsistent.
    """

    num_blocks: int
    block_stride: int
    regions: tuple[Region, ...]
    base_offset: int = 0
    tag: str = ""
    dtype: str = "uint8"

    def __post_init__(self) -> None:
        check_positive_int(self.num_blocks, "PoolSpec.num_blocks")
        check_positive_int(self.block_stride, "PoolSpec.block_stride")
        if not isinstance(self.base_offset, int) or isinstance(self.base_offset, bool) or self.base_offset < 0:
            raise UsageError("must be a non-negative int", argument="PoolSpec.base_offset")
        if not isinstance(self.tag, str):
            raise UsageError("must be a str", argument="PoolSpec.tag", value=self.tag)
        if not isinstance(self.dtype, str) or not self.dtype:
            raise UsageError("must be a non-empty str", argument="PoolSpec.dtype", value=self.dtype)
        if isinstance(self.regions, (str, bytes)) or not hasattr(self.regions, "__iter__"):
            raise UsageError(
                "must be a sequence of Region", argument="PoolSpec.regions", got=type(self.regions).__name__
            )
        regions = tuple(self.regions)
        if not regions:
            raise UsageError("needs at least one region", argument="PoolSpec.regions")
        object.__setattr__(self, "regions", regions)
        prev_end = 0
        for r in regions:
            if not isinstance(r, Region):
                raise UsageError("must hold Region objects", argument="PoolSpec.regions", got=type(r).__name__)
            if r.offset < prev_end:
                raise UsageError("regions must be sorted and must not overlap", argument="PoolSpec.regions")
            prev_end = r.end
        if prev_end > self.block_stride:
            raise UsageError(
                "regions run past the block stride",
                argument="PoolSpec.regions",
                region_end=prev_end,
                block_stride=self.block_stride,
            )

    @property
    def block_nbytes(self) -> int:
        """Live bytes per block (padding excluded)."""
        return sum(r.nbytes for r in self.regions)

    @property
    def extent(self) -> int:
        """Bytes of storage the pool spans, from offset 0 of the storage."""
        return self.base_offset + (self.num_blocks - 1) * self.block_stride + self.regions[-1].end

    def describe(self) -> bytes:
        regions = b"".join(struct.pack("<qq", r.offset, r.nbytes) for r in self.regions)
        head = struct.pack("<qqq", self.num_blocks, self.block_stride, self.base_offset)
        return head + regions + self.tag.encode() + b"|" + self.dtype.encode()


@dataclass(frozen=True, slots=True, eq=False)
class DevicePool:
    """A :class:`PoolSpec` bound to real storage.

    ``address`` is the address of storage byte 0 for host-addressable pools
    (``Device.CPU``); ``nbytes`` the storage size, checked against the spec's
    extent. ``owner`` keeps the tensor alive for as long as the pool exists.
    """

    spec: PoolSpec
    device: Device
    address: int
    nbytes: int
    layer: int = 0
    writable: bool = True
    owner: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.spec.extent > self.nbytes:
            raise UsageError(
                "pool spec reaches past the end of its storage",
                argument="spec",
                extent=self.spec.extent,
                storage_nbytes=self.nbytes,
            )
        if not isinstance(self.layer, int) or self.layer < 0:
            raise UsageError("must be a non-negative int", argument="layer", value=self.layer)


@dataclass(frozen=True, slots=True, eq=False)
class KVLayout:
    """Ordered pools of one model shard; all share ``num_blocks``.

    ``host_offsets[p]`` is where pool ``p``'s live bytes start inside a host
    block; ``host_block_nbytes`` is the host block stride.
    """

    pools: tuple[DevicePool, ...]
    host_offsets: tuple[int, ...] = field(init=False)
    host_block_nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        pools = tuple(self.pools)
        if not pools:
            raise UsageError("needs at least one pool", argument="pools")
        for i, p in enumerate(pools):
            if not isinstance(p, DevicePool):
                raise UsageError("must hold DevicePool objects", argument=f"pools[{i}]", got=type(p).__name__)
        n = pools[0].spec.num_blocks
        for i, p in enumerate(pools):
            if p.spec.num_blocks != n:
                raise UsageError(
                    "all pools must have the same num_blocks",
                    argument=f"pools[{i}]",
                    num_blocks=p.spec.num_blocks,
                    expected=n,
                )
        offsets, off = [], 0
        for p in pools:
            offsets.append(off)
            off = align_up(off + p.spec.block_nbytes)
        object.__setattr__(self, "pools", pools)
        object.__setattr__(self, "host_offsets", tuple(offsets))
        object.__setattr__(self, "host_block_nbytes", max(off, ALIGN))

    @property
    def num_blocks(self) -> int:
        return self.pools[0].spec.num_blocks

    @property
    def num_layers(self) -> int:
        return max(p.layer for p in self.pools) + 1

    @property
    def block_nbytes(self) -> int:
        """Live bytes of one block summed over all pools."""
        return sum(p.spec.block_nbytes for p in self.pools)

    @property
    def devices(self) -> frozenset[Device]:
        return frozenset(p.device for p in self.pools)

    def digest(self) -> bytes:
        """16-byte identity of the geometry (specs, tags, dtypes, layers), not of the storage."""
        h = hashlib.blake2b(digest_size=16)
        for p in self.pools:
            h.update(struct.pack("<q", p.layer) + p.spec.describe() + b";")
        return h.digest()
