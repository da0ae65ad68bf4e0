"""Handles of transfers in flight, with per-layer completion.

A :class:`TransferFuture` completes when every chunk of every layer has been
copied, or fails with the first chunk's exception. ``wait_layer(l)`` returns as
soon as layer ``l`` is fully copied, so a consumer can start computing on layer
``l`` while ``l+1`` is still moving.
"""
from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, TimeoutError as FutureTimeout

from tiersync.errors import UsageError


class Direction(enum.Enum):
    D2H = "d2h"
    H2D = "h2d"


class TransferStatus(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class TransferFuture:
    """Completion of one d2h/h2d request. Thread-safe; results are ``None``."""

    def __init__(self, direction: Direction, nbytes: int, layer_chunks: Sequence[int], host_blocks: Sequence[int]):
        self.direction = direction
        self.nbytes = nbytes
        self.host_blocks = tuple(host_blocks)
        self.started = time.perf_counter()
        self.finished: float | None = None
        self._future: Future = Future()
        self._lock = threading.Lock()
        self._remaining = list(layer_chunks)
        self._left = sum(1 for n in layer_chunks if n > 0)
        self._layer_events = [threading.Event() for _ in layer_chunks]
        for ev, n in zip(self._layer_events, layer_chunks):
            if n == 0:
                ev.set()

    def __repr__(self) -> str:
        return f"<TransferFuture {self.direction.value} {self.nbytes} B {self.status.value}>"

    @property
    def status(self) -> TransferStatus:
        if not self._future.done():
            return TransferStatus.PENDING
        return TransferStatus.FAILED if self._future.exception() else TransferStatus.DONE

    @property
    def seconds(self) -> float | None:
        """Wall time from submission to completion, or None while pending."""
        return None if self.finished is None else self.finished - self.started

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> None:
        """Wait; re-raises the transfer's error. Raises ``TimeoutError`` after ``timeout`` s."""
        try:
            return self._future.result(timeout)
        except FutureTimeout:
            raise TimeoutError(f"transfer not done after {timeout} s") from None

    wait = result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def add_done_callback(self, fn: Callable[["TransferFuture"], None]) -> None:
        self._future.add_done_callback(lambda _f: fn(self))

    def layer_done(self, layer: int) -> bool:
        return self._layer_events[self._layer_index(layer)].is_set()

    def _layer_index(self, layer: int) -> int:
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < len(self._layer_events):
            raise UsageError("no such layer", argument="layer", value=layer, num_layers=len(self._layer_events))
        return layer

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        """Block until ``layer`` is copied; raises the transfer's error if it failed first."""
        if not self._layer_events[self._layer_index(layer)].wait(timeout):
            raise TimeoutError(f"layer {layer} not done after {timeout} s")
        if self._remaining[layer] != 0:
            self._future.result()

    # -- engine side -------------------------------------------------------
    def _chunk_done(self, layer: int) -> bool:
        """Record one finished chunk; returns True when the whole transfer is done."""
        with self._lock:
            self._remaining[layer] -= 1
            if self._remaining[layer] == 0:
                self._layer_events[layer].set()
                self._left -= 1
            return self._left == 0

    def _finish(self, exc: BaseException | None) -> None:
        with self._lock:
            if self.finished is not None:
                return
            self.finished = time.perf_counter()
        for ev in self._layer_events:  # wake layer waiters; they check _remaining
            ev.set()
        if exc is None:
            self._future.set_result(None)
        else:
            self._future.set_exception(exc)
