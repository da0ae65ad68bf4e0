"""A buffer of seeded bytes in another process, for the same-host read tests (the ``source``
fixture of conftest.py starts it)."""

from __future__ import annotations

import numpy as np

NBYTES = 24 << 20
SIZES = [0, 1, 63, 64, 65, 4095, (256 << 10) - 1, 256 << 10, (256 << 10) + 1, 3 << 20, (5 << 20) + 17]
_CHILD = """
import sys, numpy as np
buf = np.random.default_rng(7).integers(0, 256, int(sys.argv[1]), dtype=np.uint8)
print(buf.ctypes.data, flush=True)
sys.stdin.read()
"""


def _expected() -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, NBYTES, dtype=np.uint8)


def _ranges(address: int) -> list[tuple[int, int]]:
    out, off = [], 0
    for n in SIZES:
        out.append((address + off, n))
        off += n + 7  # ranges that do not start on a stripe boundary of the source
    return out
