"""The byte damage both tier fuzz suites apply to a file image (the atheris targets in fuzz/
have their own, with offsets that wrap: they take raw fuzzer bytes)."""

from __future__ import annotations

import struct

import numpy as np


def damage(buf: bytearray, kind: str, at: int | float, n: int, value: int) -> tuple[bytearray, int, bool]:
    """Apply the generic kinds (flip, zero, fill, truncate, extend, u64) at ``at`` (a float: that
    fraction of the file); ``(buf, the offset used, whether the kind was one of these)``, so a
    suite handles its format's own kinds (a record count, a re-sealed header) itself."""
    at = int(at * len(buf)) if isinstance(at, float) else min(at, len(buf))
    if kind == "flip":
        if at < len(buf):
            buf[at] ^= value % 255 + 1
    elif kind in ("zero", "fill"):
        buf[at : at + n] = bytes([0 if kind == "zero" else value % 256]) * len(buf[at : at + n])
    elif kind == "truncate":
        del buf[at:]
    elif kind == "extend":
        buf += np.random.default_rng(value).bytes(n)
    elif kind == "u64":
        if at + 8 <= len(buf):
            struct.pack_into("<Q", buf, at, value)
    else:
        return buf, at, False
    return buf, at, True
