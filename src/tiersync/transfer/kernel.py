"""The byte mover: copy lists of spans between two host-addressable buffers.

Uses the native ``_kernel`` extension when it was built (GIL released,
non-temporal stores for large spans); otherwise a pure-Python fallback built on
``ctypes.memmove`` (also GIL-free per call, but with per-span Python overhead).
``KERNEL`` names the implementation in use, so benchmarks can report it.

Callers validate bounds: these functions trust their offsets.
"""
from __future__ import annotations

import ctypes

import numpy as np

try:  # pragma: no cover - depends on the build
    from tiersync.transfer import _kernel as _native
except ImportError:  # pragma: no cover
    _native = None

KERNEL = "native" if _native is not None else "python-memmove"


def copy_spans(
    src_addr: int, dst_addr: int, src_off: np.ndarray, dst_off: np.ndarray, lengths: np.ndarray,
    *, streaming: bool = True,
) -> None:
    """Copy ``lengths[i]`` bytes from ``src_addr+src_off[i]`` to ``dst_addr+dst_off[i]``.

    The three arrays are C-contiguous int64 of equal length. ``streaming`` asks
    for non-temporal stores (native kernel on x86-64 only; ignored elsewhere).
    """
    if _native is not None:
        _native.copy_spans(src_addr, dst_addr, src_off, dst_off, lengths, streaming)
        return
    move = ctypes.memmove
    for s, d, n in zip(src_off.tolist(), dst_off.tolist(), lengths.tolist()):
        move(dst_addr + d, src_addr + s, n)
