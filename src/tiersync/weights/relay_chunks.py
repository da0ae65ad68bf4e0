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
from functools import partial

import numpy as np

from tiersync.errors import RemoteError
from tiersync.net.service import Watch
from tiersync.weights.fetch import Job
from tiersync.weights.spans import StridedSpan

__all__ = ["RelayChunks"]

_Chunk = tuple[str, tuple[int, ...]]  # (tensor, global box start)
_Relay = tuple[int, Mapping[str, np.ndarray], dict[_Chunk, StridedSpan]]  # version, buffers, landed spans
_BEGIN_WAIT_S = 1.0  # how long GETs of a version this sampler has not begun wait for it, from the first
_AHEAD = 8  # versions not begun whose GETs may wait at once (more are refused)


class RelayChunks:
    """The chunks of one version that landed, in that version's buffers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # version, buffers, and each landed chunk's span in them
        self._relay: _Relay | None = None
        # wakes of GETs waiting for a chunk, or (an int) for that version to begin
        self._waits: dict[_Chunk | int, list[Callable[[], object]]] = {}
        self._begun = -1  # the version last begun or given up (a restarted trainer numbers them again)
        self._ahead: dict[int, float] = {}  # a version not begun yet -> until when its GETs wait for it

    def begin(self, version: int, buffers: Mapping[str, np.ndarray]) -> None:
        """``version`` is being landed in ``buffers`` (none of its chunks yet)."""
        self._set((version, buffers, {}), version)  # a GET waiting for the version before: it is gone

    def drop(self) -> None:
        """The version being landed failed: nothing to relay."""
        self._set(None, None)  # waiting GETs answer "not held" now, not at their timeout

    def give_up(self, version: int) -> None:
        """This sampler will not land ``version`` (its sync failed): GETs waiting for it to
        begin are refused now, not when their wait ends."""
        self._set(self._relay, max(self._begun, version))  # the sync thread alone sets _begun

    def _set(self, relay: _Relay | None, begun: int | None) -> None:
        """The relayed version and the mark below which GETs of versions not begun are refused;
        GETs waiting for a chunk, or for a version the mark now passes, are asked again (the
        others wait on, in the windows they had)."""
        with self._lock:
            if begun is not None and begun < self._begun:  # numbered again (a restarted trainer)
                self._ahead = {}
            self._relay, self._begun = relay, self._begun if begun is None else begun
            self._ahead = {v: u for v, u in self._ahead.items() if v > self._begun}
            done = [k for k in self._waits if not isinstance(k, int) or k not in self._ahead]
            wakes = [wake for k in done for wake in self._waits.pop(k)]
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
        a Watch of it while this version is landed and it is not there yet, and of a newer
        version for ``_BEGIN_WAIT_S`` from its first GET (a reader's sync may begin a moment
        before its relay's; a relay that lags more is refused, and its readers go elsewhere)."""
        chunk = (name, tuple(key))
        with self._lock:
            if self._relay is None or self._relay[0] != version:
                if self._may_wait(version):
                    return partial(self._watch, version, version)
                raise RemoteError("this sampler does not hold that chunk of that version", version=version)
            if chunk not in self._relay[2]:
                return partial(self._watch, version, chunk)
            if span != self._relay[2][chunk]:
                raise RemoteError("that is not the span this sampler landed that chunk in", version=version)
            arr = self._relay[1][name]
        return arr.reshape(-1).view(np.uint8), lambda: None  # a relay's bytes stay until the next version

    def _may_wait(self, version: int) -> bool:
        """Whether a GET of ``version``, not begun here, waits for it (the lock held); the first
        starts its wait, ended by a timer."""
        if version <= self._begun:
            return False
        until, now = self._ahead.get(version), time.monotonic()
        if until is None and len(self._ahead) >= _AHEAD:  # room again once some waits ended
            self._ahead = {v: u for v, u in self._ahead.items() if u > now}
        if until is None and len(self._ahead) < _AHEAD:
            until = self._ahead[version] = now + _BEGIN_WAIT_S
            timer = threading.Timer(_BEGIN_WAIT_S, self._wake, (version,))
            timer.daemon = True
            timer.start()
        return until is not None and now < until

    def _watch(self, version: int, key: _Chunk | int, wake: Callable[[], object]) -> None:
        with self._lock:
            waiting = self._may_wait(version) if isinstance(key, int) else self._waiting(version, key)
            if waiting:
                self._waits.setdefault(key, []).append(wake)
                return
        wake()

    def _waiting(self, version: int, chunk: _Chunk) -> bool:
        """Whether a GET of ``chunk`` of ``version`` still waits for it to land (the lock held)."""
        relay = self._relay
        return relay is not None and relay[0] == version and chunk not in relay[2]

    def _wake(self, version: int) -> None:
        """The wait of GETs for ``version`` to begin ended: they are asked again (and refused)."""
        with self._lock:
            wakes = self._waits.pop(version, [])
        for wake in wakes:
            wake()
