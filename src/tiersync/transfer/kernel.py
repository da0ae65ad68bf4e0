"""The byte mover: copy lists of spans, or a region pattern per block, between two
host-addressable buffers.

The native ``_kernel`` extension, when it was built (GIL released, non-temporal stores for
large spans); :mod:`tiersync.transfer.backends` falls back to ``ctypes.memmove`` without it.
``KERNEL`` names the implementation in use, so benchmarks can report it.

It also carries ``tsum64``, tiersync's own 64-bit payload checksum (spec in
``_kernel.c``; GIL released on large inputs, SIMD where the CPU has it).
``TSUM64`` is None when the extension is missing: callers then use another
checksum (the wire protocol negotiates, see :mod:`tiersync.net.frames`).

Callers validate bounds: these functions trust their offsets.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

try:  # pragma: no cover - depends on the build
    from tiersync.transfer import _kernel

    _native: Any = _kernel
except ImportError:  # pragma: no cover
    _native = None

KERNEL = "native" if _native is not None else "python-memmove"
TSUM64: str | None = getattr(_native, "TSUM64_IMPL", None)
"""The tsum64 stripe implementation ("avx512", "avx2", "sse2", "scalar"), or None when not built."""
STRIPE = 64
"""tsum64 reads 64-byte stripes: buffers compose (:func:`tsum64_compose`) when every one but the
last is a whole number of them."""
PARTIAL_BYTES = 17 * 8
"""Bytes of one :func:`tsum64_partial` value: 8 + 8 stripe sums and the length, native u64."""


def tsum64(data: bytes | bytearray | memoryview | list[memoryview] | tuple[memoryview, ...], seed: int = 0) -> int:
    """tsum64 of a contiguous buffer, or of the concatenation of a list or tuple of them (one
    GIL-free pass over all the parts). Raises RuntimeError when the extension is not built."""
    if TSUM64 is None:
        raise RuntimeError("tsum64 needs the native extension (tiersync.transfer._kernel)")
    return int(_native.tsum64(data, seed))


def tsum64_partial(data: bytes | bytearray | memoryview) -> bytes:
    """The partial state of ``data`` (its stripe sums from zero and its length) for
    :func:`tsum64_compose`. Raises RuntimeError when the extension is not built."""
    if TSUM64 is None:
        raise RuntimeError("tsum64 needs the native extension (tiersync.transfer._kernel)")
    return _native.tsum64_partial(data)  # type: ignore[no-any-return]


def tsum64_compose(partials: list[bytes] | tuple[bytes, ...], seed: int = 0) -> int:
    """tsum64 of the concatenation of the buffers whose :func:`tsum64_partial` values
    ``partials`` are, in order, without reading their bytes again. Every buffer but the last
    must be a whole number of 64-byte stripes (ValueError otherwise, naming the part)."""
    if TSUM64 is None:
        raise RuntimeError("tsum64 needs the native extension (tiersync.transfer._kernel)")
    return int(_native.tsum64_compose(partials, seed))


def compose_pieces(buf: np.ndarray, pieces: Iterable[tuple[int, int, int]], states: bytes) -> int:
    """tsum64 of pieces of the flat uint8 array ``buf`` back to back, each ``(offset, length,
    kept)``: ``kept >= 0`` takes partial state number ``kept`` of ``states`` (:data:`PARTIAL_BYTES`
    each, e.g. from :func:`copy_partials`; it must be of exactly those bytes, whose length it
    carries), ``-1`` sums the bytes now. Raises as :func:`tsum64_compose` (every piece but the
    last must be a whole number of stripes)."""
    size = PARTIAL_BYTES
    parts = [states[k * size : (k + 1) * size] if k >= 0 else tsum64_partial(buf[o : o + n].data) for o, n, k in pieces]
    return tsum64_compose(parts)


def copy_partials(dst: np.ndarray, src: np.ndarray, piece: int) -> bytes:
    """Copy ``src`` into ``dst`` (C-contiguous, equal byte lengths) and return the
    :func:`tsum64_partial` value of each ``piece``-byte piece of what landed, in order and
    concatenated (the last piece may be shorter): one pass, the sums taken from the very
    bytes stored. ``piece`` is a positive multiple of 64 (ValueError otherwise), so any run of
    the pieces composes. Raises RuntimeError when the extension is not built."""
    if TSUM64 is None:
        raise RuntimeError("copy_partials needs the native extension (tiersync.transfer._kernel)")
    return _native.copy_partials(dst, src, piece)  # type: ignore[no-any-return]


def tsum64_hasher(seed: int = 0) -> object:
    """An incremental tsum64: ``update(buffer)`` any number of times, then ``intdigest()``.

    Splitting never changes the result. Not for concurrent use from two threads
    (a concurrent ``update`` raises RuntimeError). Raises RuntimeError when not built.
    """
    if TSUM64 is None:
        raise RuntimeError("tsum64 needs the native extension (tiersync.transfer._kernel)")
    return _native.Tsum64(seed)


def copy_blocks(
    src_addr: int,
    dst_addr: int,
    src_blocks: np.ndarray,
    dst_blocks: np.ndarray,
    src_regions: np.ndarray,
    dst_regions: np.ndarray,
    lengths: np.ndarray,
    *,
    streaming: bool = True,
) -> None:
    """For every block pair ``i`` and region ``r``: copy ``lengths[r]`` bytes from
    ``src_addr + src_blocks[i] + src_regions[r]`` to ``dst_addr + dst_blocks[i] + dst_regions[r]``
    (a pool's regions, one loop in native code: no span array per region and block).

    All five arrays are C-contiguous int64; block arrays equal in length, region arrays too.
    """
    if _native is None:
        raise RuntimeError(
            "copy_blocks needs the native extension (tiersync.transfer._kernel); "
            "tiersync.transfer.backends.MemmoveCopier is the fallback"
        )
    _native.copy_blocks(src_addr, dst_addr, src_blocks, dst_blocks, src_regions, dst_regions, lengths, streaming)
