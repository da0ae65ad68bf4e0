"""Handles of transfers in flight, with per-layer completion.

A :class:`TransferFuture` completes when every chunk of every layer has been
copied, or fails with the first chunk's exception. ``wait_layer(l)`` returns as
soon as layer ``l`` is fully copied, so a consumer can start computing on layer
``l`` while ``l+1`` is still moving.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence

from tiersync.completion import Completion, Status
from tiersync.errors import UsageError


class Direction(enum.Enum):
    D2H = "d2h"
    H2D = "h2d"


TransferStatus = Status
"""A transfer's status: :class:`tiersync.completion.Status` (the one status of every handle)."""


class TransferFuture(Completion[None]):
    """Completion of one d2h/h2d request. Thread-safe; results are ``None``."""

    what = "transfer"

    def __init__(self, direction: Direction, nbytes: int, layer_chunks: Sequence[int], host_blocks: Sequence[int]):
        super().__init__()
        self.direction = direction
        self.nbytes = nbytes
        self.host_blocks = tuple(host_blocks)
        self.started = time.perf_counter()
        self.finished: float | None = None
        self._remaining = list(layer_chunks)  # guarded by the base's _cond, which layer waiters wait on
        self._left = sum(1 for n in layer_chunks if n > 0)

    def __repr__(self) -> str:
        return f"<TransferFuture {self.direction.value} {self.nbytes} B {self.status.value}>"

    @property
    def seconds(self) -> float | None:
        """Wall time from submission to completion, or None while pending."""
        return None if self.finished is None else self.finished - self.started

    wait = Completion.result

    def layer_done(self, layer: int) -> bool:
        """Whether ``layer`` is copied (or the transfer settled, failed included)."""
        return self._remaining[self._layer_index(layer)] == 0 or self.done()

    def _layer_index(self, layer: int) -> int:
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < len(self._remaining):
            raise UsageError("no such layer", argument="layer", value=layer, num_layers=len(self._remaining))
        return layer

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        """Block until ``layer`` is copied; raises the transfer's error if it failed first."""
        self._layer_index(layer)
        with self._cond:
            if not self._cond.wait_for(lambda: self._remaining[layer] == 0 or self.done(), timeout):
                raise TimeoutError(f"layer {layer} not done after {timeout} s")
        if self._remaining[layer] != 0:
            self.result()

    # -- engine side -------------------------------------------------------
    def _chunk_done(self, layer: int) -> bool:
        """Record one finished chunk (waking that layer's waiters when it was the layer's
        last); returns True when the whole transfer is done."""
        with self._cond:
            self._remaining[layer] -= 1
            if self._remaining[layer] == 0:
                self._left -= 1
                self._cond.notify_all()
            return self._left == 0

    def _on_end(self) -> None:
        self.finished = time.perf_counter()
