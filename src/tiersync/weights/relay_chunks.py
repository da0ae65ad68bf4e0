"""What a relaying sampler serves other samplers: the landed chunks of the version it writes.

:class:`RelayChunks` knows the version being landed (or last landed), its buffers and which of
its chunks ``(tensor, global box start)`` are there; :meth:`RelayChunks.provide` is the
:class:`~tiersync.weights.serving.SpanService` provider of the sampler's relay server. A
relay's bytes stay until the next version begins.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from functools import partial

import numpy as np

from tiersync.errors import RemoteError
from tiersync.net.service import Watch
from tiersync.weights.fetch import Job
from tiersync.weights.spans import StridedSpan

__all__ = ["RelayChunks"]

_Chunk = tuple[str, tuple[int, ...]]  # (tensor, global box start)


class RelayChunks:
    """The chunks of one version that landed, in that version's buffers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # version, buffers, and each landed chunk's span in them
        self._relay: tuple[int, Mapping[str, np.ndarray], dict[_Chunk, StridedSpan]] | None = None
        self._waits: dict[_Chunk | None, list[Callable[[], object]]] = {}  # wakes of GETs waiting for a
        # chunk, or (None) for a newer version than the newest begun or given up (``_begun``) to begin
        self._begun = -1

    def begin(self, version: int, buffers: Mapping[str, np.ndarray]) -> None:
        """``version`` is being landed in ``buffers`` (none of its chunks yet)."""
        self._set((version, buffers, {}), version)  # a GET waiting for the version before: it is gone

    def drop(self) -> None:
        """The version being landed failed: nothing to relay."""
        self._set(None, -1)  # waiting GETs answer "not held" now, not at their timeout

    def give_up(self, version: int) -> None:
        """This sampler will not land ``version`` (its sync failed before it began): GETs waiting
        for it to begin are refused now, not at their timeout."""
        with self._lock:
            self._begun = max(self._begun, version)
            wakes = self._waits.pop(None, [])
        for wake in wakes:
            wake()

    def _set(self, relay: tuple[int, Mapping[str, np.ndarray], dict[_Chunk, StridedSpan]] | None, begun: int) -> None:
        with self._lock:
            self._relay, self._begun = relay, max(self._begun, begun)
            waits, self._waits = self._waits, {}
        for wakes in waits.values():
            for wake in wakes:
                wake()

    def landed(self, jobs: Iterable[Job]) -> None:
        """The chunks of ``jobs`` are there."""
        wakes: list[Callable[[], object]] = []
        with self._lock:
            relay = self._relay
            assert relay is not None  # the sync that lands chunks began their version and has not dropped it
            for j in jobs:
                relay[2][(j.tensor, j.key)] = j.dst_span
                wakes += self._waits.pop((j.tensor, j.key), ())
        for wake in wakes:
            wake()

    def provide(
        self, version: int, name: str, key: tuple[int, ...], span: StridedSpan | None
    ) -> tuple[np.ndarray, Callable[[], None]] | Watch:
        """Relay GETs: chunk ``key`` of ``name`` once it landed in this version's buffer, for
        the span it landed in only (any other span of the buffer may hold an older version);
        a Watch of it while this version is landed and it is not there yet, or while this
        sampler has not begun that version (a reader's sync may begin before its relay's)."""
        chunk = (name, tuple(key))
        with self._lock:
            if self._relay is None or self._relay[0] != version:
                if version > self._begun:
                    return partial(self._watch, version, None)
                raise RemoteError("this sampler does not hold that chunk of that version", version=version)
            if chunk not in self._relay[2]:
                return partial(self._watch, version, chunk)
            if span != self._relay[2][chunk]:
                raise RemoteError("that is not the span this sampler landed that chunk in", version=version)
            arr = self._relay[1][name]
        return arr.reshape(-1).view(np.uint8), lambda: None  # a relay's bytes stay until the next version

    def _watch(self, version: int, chunk: _Chunk | None, wake: Callable[[], object]) -> None:
        with self._lock:
            if self._waiting(version, chunk):
                self._waits.setdefault(chunk, []).append(wake)
                return
        wake()

    def _waiting(self, version: int, chunk: _Chunk | None) -> bool:
        """Whether a GET of ``chunk`` of ``version`` (None: for that version to begin) still
        waits (the lock held)."""
        if chunk is None:
            return version > self._begun
        relay = self._relay
        return relay is not None and relay[0] == version and chunk not in relay[2]
