"""A sampler actor for the Ray kill test: stuck inside one version's sync once part of it landed.

Imported by the Ray workers by module name (the test puts this directory and the example's on
their ``PYTHONPATH``).
"""

from __future__ import annotations

import threading

from ray_workers import SamplerWorker

from tiersync.weights import TransportKind


class StallingSampler(SamplerWorker):
    """A :class:`SamplerWorker` whose progress hook blocks forever in version ``stall`` after
    the first chunk of it landed: the sync can neither finish nor be answered, so a
    ``ray.kill`` lands mid-sync. Shared memory with one copy thread: chunks land one at a
    time, so the first one is not the whole version (:meth:`wait_stalled` says how much)."""

    def __init__(self, *args, stall: int, **kwargs) -> None:
        self._stall, self._stalled, self._at = stall, threading.Event(), (0, 0)
        super().__init__(*args, transport=TransportKind.SHM, copy_threads=1, **kwargs)

    def _progress(self, version: int, done: int, total: int) -> None:
        super()._progress(version, done, total)
        if version != self._stall:
            return
        if not self._stalled.is_set():
            self._at = (done, total)
            self._stalled.set()
        threading.Event().wait()  # stuck mid-sync until the actor is killed

    def wait_stalled(self, timeout: float) -> tuple[int, int]:
        """Once stuck: (bytes of the version landed, bytes of the version)."""
        if not self._stalled.wait(timeout):
            raise TimeoutError(f"version {self._stall} did not start landing within {timeout} s")
        return self._at
