"""Sizes as people type them: ``parse_size("8GiB")``. A leaf: imports nothing of tiersync but errors."""

from __future__ import annotations

import re

from tiersync.errors import UsageError

__all__ = ["parse_size"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def parse_size(text: str, argument: str = "size") -> int:
    """ "8GiB" / "512MiB" / "4096" -> bytes (> 0). UsageError naming ``argument`` when malformed."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", str(text))
    if m is None or m.group(2).lower() not in _UNITS or int(m.group(1)) <= 0:
        raise UsageError("must be a size such as 8GiB", argument=argument, value=text)
    return int(m.group(1)) * _UNITS[m.group(2).lower()]
