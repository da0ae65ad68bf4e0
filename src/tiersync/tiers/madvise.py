"""``madvise(2)`` on any address range of this process: :meth:`mmap.mmap.madvise` covers only
maps Python made, not an engine's tensors. The GIL is released for the call (ctypes)."""

from __future__ import annotations

import ctypes
import functools

__all__ = ["madvise"]


@functools.cache
def _libc_madvise() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def madvise(address: int, length: int, advice: int) -> int:
    """Advise the kernel about ``[address, address + length)``: 0, or the errno it refused with."""
    return 0 if _libc_madvise()(address, length, advice) == 0 else ctypes.get_errno()
