"""Waiting, in a test, for a condition another thread or process brings about: bounded polling."""

from __future__ import annotations

import threading
from collections.abc import Callable


def until(predicate: Callable[[], object], timeout: float = 10.0, interval: float = 0.01) -> bool:
    """Whether ``predicate()`` became true within ``timeout`` seconds (checked every ``interval``)."""
    pause = threading.Event()
    for _ in range(max(1, int(timeout / interval))):
        if predicate():
            return True
        pause.wait(interval)
    return bool(predicate())
