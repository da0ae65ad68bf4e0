"""Layer 2: async block copies between device pools and the host arena.

Names load on first use (PEP 562), so importing one submodule (e.g. ``kernel`` for the
payload checksum of the net layer) does not pull in numpy and the engine.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "TransferConfig": "engine",
    "TransferEngine": "engine",
    "Direction": "future",
    "TransferFuture": "future",
    "TransferStatus": "future",
    "KERNEL": "kernel",
}
__all__ = ["KERNEL", "Direction", "TransferConfig", "TransferEngine", "TransferFuture", "TransferStatus"]


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
