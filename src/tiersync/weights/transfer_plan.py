"""The data a resharding plan is made of: tensor specs, options, transfers and the plan.

Everything here is a frozen value. A :class:`TransferPlan` is produced by
:func:`tiersync.weights.planner.plan_transfer` and consumed by executors
(:func:`tiersync.weights.executor.execute_local` in-process, a networked one later).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from tiersync.errors import UsageError
from tiersync.weights.sharding import Box, Sharding, _check_int
from tiersync.weights.spans import StridedSpan

__all__ = ["PlanOptions", "TensorSpec", "Transfer", "TransferKind", "TransferPlan", "dtype_info"]

# Element sizes of ML dtypes numpy may not know (torch / ml_dtypes names).
_EXTRA_DTYPES = {
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
}


def dtype_info(dtype: Any) -> tuple[str, int]:
    """``(name, itemsize)`` for a numpy dtype, a dtype name, or a torch/JAX dtype object.

    Never imports torch or JAX: foreign dtypes are recognised by name (``torch.bfloat16`` ->
    ``"bfloat16"``). Raises :class:`UsageError` (argument ``dtype``) when unknown.
    """
    if dtype is None:
        raise UsageError("a dtype is required", argument="dtype")
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is not None and dt.kind != "O" and dt.itemsize > 0:
        return dt.name, dt.itemsize
    name = dtype if isinstance(dtype, str) else str(dtype)
    name = name.rsplit(".", 1)[-1]
    if name in _EXTRA_DTYPES:
        return name, _EXTRA_DTYPES[name]
    try:
        dt = np.dtype(name)
    except TypeError:
        raise UsageError("unknown dtype", argument="dtype", dtype=dtype) from None
    if dt.kind == "O" or dt.itemsize == 0:
        raise UsageError("dtype has no fixed element size", argument="dtype", dtype=dtype)
    return dt.name, dt.itemsize


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A tensor's global ``shape`` and ``dtype``; ``dtype`` is normalised to its name."""

    shape: tuple[int, ...]
    dtype: str
    itemsize: int = field(init=False)

    def __post_init__(self) -> None:
        if isinstance(self.shape, (str, bytes)) or not hasattr(self.shape, "__iter__"):
            raise UsageError("expected a sequence of ints", argument="shape", value=self.shape)
        shape = tuple(_check_int(s, "shape", 0) for s in self.shape)
        name, itemsize = dtype_info(self.dtype)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", name)
        object.__setattr__(self, "itemsize", itemsize)

    @property
    def nbytes(self) -> int:
        """Size of the global tensor in bytes."""
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """Planner knobs.

    ``fanout`` (k >= 1): the most receivers one sender serves per chunk; a chunk wanted by
    more than k receivers goes out as a tree broadcast where receivers relay.
    ``segment_bytes``: when set (>= 1), chunks larger than this are cut along their
    outermost dimension into pieces of about this size, each with its own tree, so relays
    forward piece j while piece j+1 arrives (pipelining) and pushers balance finer.
    """

    fanout: int = 64
    segment_bytes: int | None = None

    def __post_init__(self) -> None:
        _check_int(self.fanout, "fanout", 1)
        if self.segment_bytes is not None:
            _check_int(self.segment_bytes, "segment_bytes", 1)


class TransferKind(enum.Enum):
    """Where a transfer's bytes come from."""

    PUSH = "push"  #: from a source rank's source shard buffer
    RELAY = "relay"  #: from a destination rank's already received destination shard buffer


@dataclass(frozen=True, slots=True)
class Transfer:
    """One chunk sent from ``src_rank`` to destination rank ``dst_rank``.

    ``global_box`` is the region of tensor ``tensor``. ``src_box`` is that region in the
    sender's local buffer (its source shard for PUSH, its destination shard for RELAY) and
    ``dst_box`` in the receiver's destination shard. ``src_span``/``dst_span`` are the same
    bytes relative to those C-contiguous buffers. ``stage`` is the depth in the broadcast
    tree: pushes are stage 0; a RELAY of stage s may start once ``src_rank`` has received
    the same ``(tensor, global_box)`` (a transfer of stage s - 1).
    """

    tensor: str
    kind: TransferKind
    src_rank: int
    dst_rank: int
    global_box: Box
    src_box: Box
    dst_box: Box
    src_span: StridedSpan
    dst_span: StridedSpan
    stage: int

    @property
    def nbytes(self) -> int:
        """Bytes moved."""
        return self.dst_span.nbytes


@dataclass(frozen=True, slots=True, eq=False)
class TransferPlan:
    """A complete resharding plan. Compared by identity; treat as immutable.

    ``transfers`` is ordered by ``(stage, dst_rank, tensor, global_box)``. ``source`` and
    ``destination`` map each tensor name to its sharding; ``tensors`` to its spec.
    """

    tensors: Mapping[str, TensorSpec]
    source: Mapping[str, Sharding]
    destination: Mapping[str, Sharding]
    options: PlanOptions
    transfers: tuple[Transfer, ...]
    by_destination: Mapping[int, tuple[Transfer, ...]] = field(init=False)

    def __post_init__(self) -> None:
        groups: dict[int, list[Transfer]] = {}
        for t in self.transfers:
            groups.setdefault(t.dst_rank, []).append(t)
        for name in ("tensors", "source", "destination"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))
        by_dst = {r: tuple(groups[r]) for r in sorted(groups)}
        object.__setattr__(self, "by_destination", MappingProxyType(by_dst))

    def for_destination(self, rank: int) -> tuple[Transfer, ...]:
        """Transfers received by ``rank`` (empty when it receives nothing)."""
        return self.by_destination.get(rank, ())

    @property
    def depth(self) -> int:
        """Number of stages (0 for an empty plan)."""
        return 1 + max((t.stage for t in self.transfers), default=-1)

    def stages(self) -> tuple[tuple[Transfer, ...], ...]:
        """Transfers grouped by stage, stage 0 first."""
        out: list[list[Transfer]] = [[] for _ in range(self.depth)]
        for t in self.transfers:
            out[t.stage].append(t)
        return tuple(tuple(s) for s in out)

    def sent_bytes(self, kind: TransferKind = TransferKind.PUSH) -> dict[int, int]:
        """Bytes sent per sender rank by transfers of ``kind`` (pushers by default)."""
        out: dict[int, int] = {}
        for t in self.transfers:
            if t.kind is kind:
                out[t.src_rank] = out.get(t.src_rank, 0) + t.nbytes
        return out

    def chunk_counts(self) -> dict[tuple[int, str], int]:
        """``(dst_rank, tensor) -> number of chunks``: a receiver's tensor is complete
        (ready for H2D) once that many chunks of it have arrived."""
        out: dict[tuple[int, str], int] = {}
        for t in self.transfers:
            key = (t.dst_rank, t.tensor)
            out[key] = out.get(key, 0) + 1
        return out

    @property
    def total_bytes(self) -> int:
        """Bytes moved by all transfers (pushes and relays)."""
        return sum(t.nbytes for t in self.transfers)
