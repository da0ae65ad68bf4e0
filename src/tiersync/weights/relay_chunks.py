"""What a relaying sampler serves other samplers: the landed chunks of the version it writes.

:class:`RelayChunks` knows the version being landed (or last landed), its buffers and which of
its chunks ``(tensor, global box start)`` are there; :meth:`RelayChunks.provide` is the
:class:`~tiersync.weights.serving.SpanService` provider of the sampler's relay server. A
relay's bytes stay until the next version begins.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from tiersync.errors import RemoteError
from tiersync.weights.fetch import Job
from tiersync.weights.spans import StridedSpan

__all__ = ["RelayChunks"]

_Chunk = tuple[str, tuple[int, ...]]  # (tensor, global box start)


class RelayChunks:
    """The chunks of one version that landed, in that version's buffers."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        # version, buffers, and each landed chunk's span in them
        self._relay: tuple[int, Mapping[str, np.ndarray], dict[_Chunk, StridedSpan]] | None = None

    def begin(self, version: int, buffers: Mapping[str, np.ndarray]) -> None:
        """``version`` is being landed in ``buffers`` (none of its chunks yet)."""
        with self._cond:
            self._relay = (version, buffers, {})
            self._cond.notify_all()  # a GET waiting for the version before: it is gone

    def drop(self) -> None:
        """The version being landed failed: nothing to relay."""
        with self._cond:
            self._relay = None
            self._cond.notify_all()  # waiting GETs answer "not held" now, not at their timeout

    def landed(self, jobs: Iterable[Job]) -> None:
        """The chunks of ``jobs`` are there."""
        with self._cond:
            relay = self._relay
            assert relay is not None  # the sync that lands chunks began their version and has not dropped it
            relay[2].update(((j.tensor, j.key), j.dst_span) for j in jobs)
            self._cond.notify_all()

    def provide(
        self, version: int, name: str, key: tuple[int, ...], span: StridedSpan | None, timeout: float
    ) -> tuple[np.ndarray, Callable[[], None]]:
        """Relay GETs: chunk ``key`` of ``name`` once it landed in this version's buffer, for
        the span it landed in only (any other span of the buffer may hold an older version)."""
        end, chunk = time.monotonic() + timeout, (name, tuple(key))
        with self._cond:
            while self._relay is not None and self._relay[0] == version and chunk not in self._relay[2]:
                if not self._cond.wait(max(0.0, end - time.monotonic())):
                    break
            if self._relay is None or self._relay[0] != version or chunk not in self._relay[2]:
                raise RemoteError("this sampler does not hold that chunk of that version (yet)", version=version)
            if span != self._relay[2][chunk]:
                raise RemoteError("that is not the span this sampler landed that chunk in", version=version)
            arr = self._relay[1][name]
        return arr.reshape(-1).view(np.uint8), lambda: None  # a relay's bytes stay until the next version
