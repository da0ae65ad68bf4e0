"""Checksums of a trainer shard's spans composed from sums taken while the version was written.

A trainer shard copies each tensor of a version into its version buffer, then every sampler
GETs spans of it, each answer carrying the span's tsum64. Summing a span when it is first
asked for reads its bytes once more, cold, on the trainer's critical path. :class:`PieceSums`
instead copies each tensor in with :func:`~tiersync.transfer.kernel.copy_partials` (one pass:
the bytes stored and their sums come from the same registers) and keeps the partial state of
every :data:`PIECE` bytes of it. tsum64 is a Fletcher pair, so the checksum of any contiguous
span that starts on a 64-byte stripe is the composition of: the partial state of its head up
to the first piece boundary, the states of the whole pieces inside it, and that of its tail
(head and tail are summed from the bytes: less than a piece each). Spans that do not start
on a stripe, strided spans, spans inside one piece, or a build without the native checksum get
None: the caller sums them from the bytes as before.

The sums are of the bytes as they were stored; a GET reads them while the version is served
and its bytes never change meanwhile (:class:`~tiersync.weights.publish_buffer.PublishBuffer`).
"""

from __future__ import annotations

import numpy as np

from tiersync.transfer import kernel
from tiersync.weights.spans import StridedSpan

__all__ = ["PIECE", "PieceSums", "span_sum"]

PIECE = 256 << 10
"""Bytes per kept partial state (a multiple of 64): head and tail sums read less than this."""


class PieceSums:
    """The partial states of the pieces of ``count`` tensors of the version being written."""

    def __init__(self, count: int) -> None:
        self._states: list[bytes | None] = [None] * count

    def reset(self) -> None:
        """A new version: no tensor's sums are known."""
        self._states = [None] * len(self._states)

    def copy_in(self, i: int, dst: np.ndarray, src: np.ndarray, lo: int = 0) -> None:
        """Copy bytes ``src`` of tensor ``i`` into ``dst`` (flat uint8), where they begin ``lo``
        bytes into the tensor: 0, or where the previous part of it ended (a multiple of
        :data:`PIECE`), keeping its pieces' sums (none kept without the native checksum, for a
        source not C-contiguous, or when a part does not start on a piece)."""
        known = self._states[i] if lo else b""
        whole = lo % PIECE == 0 and known is not None and len(known) == lo // PIECE * kernel.PARTIAL_BYTES
        if known is None or kernel.TSUM64 is None or not src.flags.c_contiguous or not whole:
            self._states[i] = None
            np.copyto(dst, src)
            return
        self._states[i] = known + kernel.copy_partials(dst, src, PIECE)

    def of(self, i: int, nbytes: int) -> bytes | None:
        """The partial states of the pieces of tensor ``i``'s first ``nbytes`` (all written; a
        multiple of :data:`PIECE` or the tensor's size) for :func:`span_sum`, None when not kept."""
        states = self._states[i]
        return None if states is None else states[: -(-nbytes // PIECE) * kernel.PARTIAL_BYTES]


def span_sum(states: bytes | None, flat: np.ndarray, span: StridedSpan) -> int | None:
    """tsum64 of ``span`` of a tensor whose stored bytes are ``flat`` and whose pieces' partial
    states are ``states`` (:meth:`PieceSums.of`, taken of exactly the bytes of ``flat``: the
    tensor, or the part of it written so far); None when it cannot be composed (see the module)."""
    lo, hi = span.offset, span.offset + span.row_bytes
    if states is None or not span.is_contiguous or lo % kernel.STRIPE or hi > flat.size:
        return None
    count = len(states) // kernel.PARTIAL_BYTES
    first = -(-lo // PIECE)
    last = count if hi == flat.size else hi // PIECE  # whole pieces [first, last)
    if first >= last:
        return None
    pieces = [(lo, first * PIECE - lo, -1)] if lo < first * PIECE else []  # the head, summed now
    pieces += [(k * PIECE, min(PIECE, flat.size - k * PIECE), k) for k in range(first, last)]  # kept
    if last * PIECE < hi:
        pieces.append((last * PIECE, hi - last * PIECE, -1))  # the tail
    return kernel.compose_pieces(flat, pieces, states)
