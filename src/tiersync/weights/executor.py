"""The reference executor: apply a :class:`TransferPlan` in-process with numpy.

It moves bytes exactly as a networked executor would: by the byte spans of each transfer,
stage by stage (relays read from the destination buffers filled by earlier stages). Tests
use it as the oracle; nothing here is tuned for speed.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import cast

import numpy as np

from tiersync.errors import UsageError
from tiersync.weights.sharding import Box, shard_boxes
from tiersync.weights.spans import StridedSpan
from tiersync.weights.transfer_plan import TransferKind, TransferPlan

__all__ = ["allocate_destination", "execute_local", "span_view"]

Shards = Mapping[int, Mapping[str, np.ndarray]]


def span_view(buffer: np.ndarray, span: StridedSpan) -> np.ndarray:
    """A writable uint8 view of ``span``'s bytes in C-contiguous ``buffer``.

    The view has shape ``span.counts + (span.row_bytes,)``. :class:`UsageError` when the
    span reaches past the buffer or the buffer is not C-contiguous.
    """
    if not buffer.flags.c_contiguous:
        raise UsageError("buffer must be C-contiguous", argument="buffer")
    flat = buffer.reshape(-1).view(np.uint8)
    if span.extent > flat.size:
        raise UsageError("span reaches past the buffer", argument="span", extent=span.extent, nbytes=flat.size)
    base = flat[span.offset :]
    return np.lib.stride_tricks.as_strided(
        base, shape=span.counts + (span.row_bytes,), strides=span.strides + (1,), writeable=True
    )


def allocate_destination(plan: TransferPlan, *, fill: int = 0) -> dict[int, dict[str, np.ndarray]]:
    """Zero-filled (or ``fill``-filled, bytewise) local destination shards for ``plan``.

    Every rank of every destination mesh gets every tensor, even when it receives nothing
    (an empty or unchanged shard). Foreign dtypes numpy lacks are allocated as raw bytes
    with a trailing itemsize dimension.
    """
    out: dict[int, dict[str, np.ndarray]] = {}
    for name, spec in plan.tensors.items():
        for rank, box in shard_boxes(spec.shape, plan.destination[name]).items():
            arr = np.empty(_alloc_shape(box.shape, spec.dtype, spec.itemsize), dtype=_np_dtype(spec.dtype))
            arr.reshape(-1).view(np.uint8)[...] = fill
            out.setdefault(rank, {})[name] = arr
    return out


def execute_local(
    plan: TransferPlan,
    src_shards: Shards,
    dst_shards: MutableMapping[int, MutableMapping[str, np.ndarray]] | None = None,
) -> MutableMapping[int, MutableMapping[str, np.ndarray]]:
    """Apply ``plan``: copy every transfer's bytes into ``dst_shards`` and return it.

    ``src_shards[rank][name]`` is a source rank's C-contiguous local shard of tensor
    ``name`` (shape = its shard box, dtype = the plan's). ``dst_shards`` has the same form
    for destination ranks; when ``None`` it is allocated by :func:`allocate_destination`.
    Only the shards the plan touches are checked and used. Raises :class:`UsageError`
    naming ``src_shards`` or ``dst_shards`` when a needed shard is missing or has the
    wrong shape, dtype or layout.
    """
    if not isinstance(plan, TransferPlan):
        raise UsageError("expected a TransferPlan", argument="plan", value=type(plan))
    if dst_shards is None:
        # a fresh dict of dicts nobody else holds: the caller may treat it as mutable mappings
        dst_shards = cast("MutableMapping[int, MutableMapping[str, np.ndarray]]", allocate_destination(plan))
    boxes: dict[tuple[bool, str], dict[int, Box]] = {}
    for stage in plan.stages():
        for t in stage:
            if t.kind is TransferKind.PUSH:
                src = _shard(src_shards, t.src_rank, t.tensor, "src_shards", plan, boxes, source=True)
            else:
                src = _shard(dst_shards, t.src_rank, t.tensor, "dst_shards", plan, boxes, source=False)
            dst = _shard(dst_shards, t.dst_rank, t.tensor, "dst_shards", plan, boxes, source=False)
            out = span_view(dst, t.dst_span)
            out[...] = span_view(src, t.src_span).reshape(out.shape)
    return dst_shards


def _shard(
    shards: Shards,
    rank: int,
    name: str,
    argument: str,
    plan: TransferPlan,
    boxes: dict[tuple[bool, str], dict[int, Box]],
    *,
    source: bool,
) -> np.ndarray:
    try:
        arr = shards[rank][name]
    except (KeyError, TypeError, IndexError):
        raise UsageError(f"missing shard of {name!r} for rank {rank}", argument=argument) from None
    spec = plan.tensors[name]
    if (source, name) not in boxes:
        sharding = plan.source[name] if source else plan.destination[name]
        boxes[(source, name)] = shard_boxes(spec.shape, sharding)
    want = boxes[(source, name)][rank].shape
    if not isinstance(arr, np.ndarray):
        raise UsageError(f"shard of {name!r} on rank {rank} is not a numpy array", argument=argument)
    if arr.dtype.itemsize == spec.itemsize and arr.dtype.name == spec.dtype:
        shape_ok = arr.shape == want
    else:
        shape_ok = arr.dtype == np.uint8 and arr.shape == want + (spec.itemsize,)
    if not shape_ok:
        raise UsageError(
            f"shard of {name!r} on rank {rank} has the wrong shape or dtype",
            argument=argument,
            shape=arr.shape,
            dtype=str(arr.dtype),
            expected_shape=want,
            expected_dtype=spec.dtype,
        )
    if not arr.flags.c_contiguous:
        raise UsageError(f"shard of {name!r} on rank {rank} is not C-contiguous", argument=argument)
    if not source and not arr.flags.writeable:
        raise UsageError(f"shard of {name!r} on rank {rank} is read-only", argument=argument)
    return arr


def _np_dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        return np.dtype(np.uint8)


def _alloc_shape(shape: tuple[int, ...], name: str, itemsize: int) -> tuple[int, ...]:
    try:
        np.dtype(name)
        return shape
    except TypeError:
        return shape + (itemsize,)
