"""Pacing: a cap on bytes in flight and an optional bandwidth cap.

Copies compete with compute for memory bandwidth and cores; pacing keeps a
transfer from taking all of either. :meth:`Pacer.acquire` blocks until the
chunk fits under ``max_inflight_bytes`` and, with a bandwidth cap, until the
token bucket allows it; :meth:`Pacer.release` returns the bytes.
"""

from __future__ import annotations

import threading
import time

from tiersync.errors import ClosedError, UsageError


class Pacer:
    """Thread-safe byte budget. A chunk larger than the whole budget still runs, alone."""

    def __init__(self, max_inflight_bytes: int, bandwidth_bytes_per_s: float | None = None) -> None:
        if max_inflight_bytes <= 0:
            raise UsageError("must be positive", argument="max_inflight_bytes", value=max_inflight_bytes)
        if bandwidth_bytes_per_s is not None and bandwidth_bytes_per_s <= 0:
            raise UsageError("must be positive or None", argument="bandwidth_bytes_per_s")
        self.max_inflight_bytes = max_inflight_bytes
        self.rate = bandwidth_bytes_per_s
        self._inflight = 0
        self._next_at = 0.0
        self._closed = False
        self._cv = threading.Condition()

    @property
    def inflight(self) -> int:
        return self._inflight

    def acquire(self, nbytes: int) -> None:
        """Wait for room for ``nbytes``; raises :class:`ClosedError` once closed."""
        with self._cv:
            while not self._closed and self._inflight > 0 and self._inflight + nbytes > self.max_inflight_bytes:
                self._cv.wait()
            if self._closed:
                raise ClosedError("pacer closed")
            self._inflight += nbytes
            delay = 0.0
            if self.rate is not None:
                now = time.monotonic()
                start = max(now, self._next_at)
                self._next_at = start + nbytes / self.rate
                delay = start - now
        if delay > 0:
            time.sleep(delay)

    def try_acquire(self, nbytes: int) -> bool:
        """:meth:`acquire` without waiting: False (nothing taken) when it would wait for room
        or for the bandwidth cap's schedule, or when closed."""
        with self._cv:
            if self._closed or self.rate is not None:
                return False
            if self._inflight > 0 and self._inflight + nbytes > self.max_inflight_bytes:
                return False
            self._inflight += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self._cv:
            self._inflight -= nbytes
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
