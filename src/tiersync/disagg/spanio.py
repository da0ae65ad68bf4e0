"""Gather byte spans out of a layer buffer and scatter them into one, vectorised with numpy.

Spans are ``(offset, nbytes)`` rows (the ``[src_offset, dst_offset, nbytes]`` arrays of
:meth:`~tiersync.disagg.reshard.ReshardPlan.route_spans`). Many small spans (one per token
when heads are split) are moved with one fancy-indexing copy over rows of ``g`` bytes, ``g``
the gcd of every offset and length; a few large spans are moved slice by slice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tiersync.errors import UsageError

__all__ = ["apply_plan", "byte_view", "gather", "route_slice", "scatter"]

_SLICE_SPANS = 32  # at most this many spans, or spans this large on average: plain slices
_SLICE_AVG = 1 << 16


def byte_view(buffer: Any, nbytes: int, *, writable: bool, argument: str) -> np.ndarray:
    """A flat uint8 view (no copy) of a C-contiguous buffer of exactly ``nbytes`` bytes.

    Accepts numpy arrays and anything with the buffer protocol (bytearray, mmap, memoryview; a
    torch CPU tensor via ``t.numpy()``). Raises :class:`UsageError` naming ``argument``.
    """
    try:
        mv = memoryview(buffer)
    except TypeError:
        raise UsageError(
            "must support the buffer protocol (numpy array, bytearray, mmap)",
            argument=argument,
            got=type(buffer).__name__,
        ) from None
    if not mv.c_contiguous:
        raise UsageError("must be C-contiguous", argument=argument)
    if writable and mv.readonly:
        raise UsageError("must be writable", argument=argument)
    if mv.nbytes != nbytes:
        raise UsageError("has the wrong size for the layout", argument=argument, nbytes=mv.nbytes, expected=nbytes)
    return np.frombuffer(mv.cast("B"), dtype=np.uint8) if mv.nbytes else np.zeros(0, np.uint8)


def _row_index(offsets: np.ndarray, lengths: np.ndarray, g: int) -> np.ndarray:
    starts, counts = offsets // g, lengths // g
    total = int(counts.sum())
    shift = np.repeat(starts - (np.cumsum(counts) - counts), counts)
    index: np.ndarray = np.arange(total, dtype=np.int64) + shift
    return index


def _rows(buf: np.ndarray, g: int) -> np.ndarray:
    return buf[: buf.size // g * g].reshape(-1, g)


def _use_slices(lengths: np.ndarray) -> bool:
    return lengths.size <= _SLICE_SPANS or int(lengths.sum()) // max(lengths.size, 1) >= _SLICE_AVG


def gather(buf: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Concatenate ``buf[o:o+n]`` for every span, in order, into ``out`` (allocated when None)."""
    total = int(lengths.sum())
    if out is None:
        out = np.empty(total, dtype=np.uint8)
    if _use_slices(lengths):
        pos = 0
        for o, n in zip(offsets.tolist(), lengths.tolist()):
            out[pos : pos + n] = buf[o : o + n]
            pos += n
        return out
    g = int(np.gcd.reduce(np.concatenate([offsets, lengths])))
    out[:total].reshape(-1, g)[:] = _rows(buf, g)[_row_index(offsets, lengths, g)]
    return out


def scatter(buf: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, payload: np.ndarray) -> None:
    """Write consecutive pieces of ``payload`` to ``buf[o:o+n]`` for every span, in order."""
    if _use_slices(lengths):
        pos = 0
        for o, n in zip(offsets.tolist(), lengths.tolist()):
            buf[o : o + n] = payload[pos : pos + n]
            pos += n
        return
    g = int(np.gcd.reduce(np.concatenate([offsets, lengths])))
    _rows(buf, g)[_row_index(offsets, lengths, g)] = payload[: int(lengths.sum())].reshape(-1, g)


def route_slice(offsets: np.ndarray, lengths: np.ndarray, start: int, nbytes: int) -> tuple[np.ndarray, np.ndarray]:
    """The spans (``offsets``, ``lengths``) that hold bytes ``[start, start + nbytes)`` of their
    concatenation, the first and last trimmed: how one pull of a route is cut out of a layer."""
    ends = np.cumsum(lengths)
    first = int(np.searchsorted(ends, start, side="right"))
    last = int(np.searchsorted(ends - lengths, start + nbytes, side="left"))
    offs, lens = offsets[first:last].copy(), lengths[first:last].copy()
    if lens.size:
        skip = start - int(ends[first] - lengths[first])
        offs[0] += skip
        lens[0] -= skip
        lens[-1] -= int(ends[last - 1]) - (start + nbytes)
    return offs, lens


def apply_plan(plan: Any, src_layers: Sequence[Sequence[Any]], dst_layers: Sequence[Sequence[Any]]) -> None:
    """Run ``plan`` in-process: ``src_layers[rank][layer]`` -> ``dst_layers[rank][layer]``.

    Buffers are validated like :func:`byte_view` (the destination must be writable). Used by
    tests and by single-host setups; the networked path is producer/consumer.
    """
    src_n, dst_n = plan.src.layer_nbytes, plan.dst.layer_nbytes
    for s in range(plan.src.tp_size):
        for d in range(plan.dst.tp_size):
            spans = plan.route_spans(s, d)
            if spans.shape[0] == 0:
                continue
            for layer in range(plan.num_layers):
                sv = byte_view(src_layers[s][layer], src_n, writable=False, argument=f"src_layers[{s}][{layer}]")
                dv = byte_view(dst_layers[d][layer], dst_n, writable=True, argument=f"dst_layers[{d}][{layer}]")
                scatter(dv, spans[:, 1], spans[:, 2], gather(sv, spans[:, 0], spans[:, 2]))
