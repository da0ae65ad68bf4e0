"""A sampler's versions: the ones to sync, in announce order, and the futures waiting on them.

:class:`VersionQueue` hands the sync loop each announced version once; :meth:`VersionQueue.receive`
is :meth:`~tiersync.weights.receiver.WeightReceiver.receive`: a future resolved once that
version or a later one is active, failed when that version's sync failed (or the receiver closed).
A version is :class:`Announced`: its number and what the trainer shards were when it was
announced. A restarted trainer announces numbers again, and each is synced; once one of a later
epoch (:mod:`~tiersync.weights.links`) is announced, :meth:`VersionQueue.receive` compares
numbers with the new numbering only (the failures and the active version of the one before are
forgotten, a future still waiting on the old numbering fails with RemoteError, and what versions
of an earlier epoch settle later is not reported).
"""

from __future__ import annotations

import copy
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass

from tiersync.errors import ClosedError, RemoteError, UsageError
from tiersync.weights.config import ReceiveResult

__all__ = ["Announced", "VersionQueue"]

KEPT_FAILURES = 64  # failed versions remembered for receive(); an older one waits for a later version
KEPT_QUEUED = 4096  # announced versions remembered so a version is synced once (any shard may announce it)


@dataclass(frozen=True, slots=True)
class Announced:
    """Version ``version``, as a trainer shard announced it in ``epoch`` (how many times a shard
    came back as another process, as this sampler saw it). ``shards[r]``: trainer shard ``r``'s
    ``(incarnation, registration)`` then, None when its link was down."""

    version: int
    epoch: int
    shards: tuple[tuple[int, int] | None, ...]

    def incarnations(self) -> tuple[int, ...]:
        """Per shard, its incarnation when this was announced (0: down then)."""
        return tuple(0 if s is None else s[0] for s in self.shards)


class VersionQueue:
    """The versions announced, synced and failed, and who waits on which."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # a future's callback may call receive()
        self._queue: queue.SimpleQueue[Announced | None] = queue.SimpleQueue()
        self._queued: dict[tuple[int, tuple[tuple[int, int] | None, ...]], None] = {}  # in announce order
        self._epoch = 0  # of the latest version announced
        self._waiters: dict[int, list[Future[ReceiveResult]]] = {}
        self._failed: dict[int, BaseException] = {}
        self._last: ReceiveResult | None = None
        self._closed = False

    def announced(self, got: Announced) -> None:
        """A trainer shard announced ``got``: queue it for the sync loop (once per version and
        state of the shards: every shard announces each version)."""
        stale: list[Future[ReceiveResult]] = []
        with self._lock:
            if (got.version, got.shards) not in self._queued:
                if got.epoch > self._epoch:  # another numbering: its failures, its last version, its waiters
                    self._failed.clear()
                    self._last, self._epoch = None, got.epoch
                    stale = [f for waiting in self._waiters.values() for f in waiting]
                    self._waiters.clear()
                self._queued[(got.version, got.shards)] = None
                self._queue.put(got)
        for f in stale:  # outside the lock, as in settle
            f.set_exception(RemoteError("a trainer shard restarted: its versions are numbered anew"))

    def next(self) -> Announced | None:
        """The next announced version to sync (blocking); None once stopped."""
        version = self._queue.get()
        return None if version is None or self._closed else version

    def receive(self, version: int) -> Future[ReceiveResult]:
        """A future resolved once version ``version`` or a later one is active (its result names
        which); failed with the sync's error when version ``version`` itself failed."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise UsageError("must be an int >= 0", argument="version", value=version)
        fut: Future[ReceiveResult] = Future()
        with self._lock:
            if self._closed:
                raise ClosedError("receiver closed", argument="receiver")
            if self._last is not None and self._last.version >= version:
                fut.set_result(self._last)
            elif version in self._failed:
                fut.set_exception(self._failed[version])
            else:
                self._waiters.setdefault(version, []).append(fut)
        return fut

    def settle(self, version: int, result: ReceiveResult | None, error: BaseException | None, epoch: int = 0) -> None:
        """Version ``version`` (announced in ``epoch``) is active (``result``) or failed
        (``error``): resolve its waiters; nothing when a later epoch numbers versions anew."""
        with self._lock:
            if epoch < self._epoch:
                return
            if result is not None:
                self._last = result
                done = [f for v in [v for v in self._waiters if v <= version] for f in self._waiters.pop(v)]
            else:
                assert error is not None  # the sync loop settles a version with a result or its error
                self._failed[version] = _bare(error)  # the waiters now get ``error`` itself
                while len(self._failed) > KEPT_FAILURES:
                    del self._failed[min(self._failed)]
                done = self._waiters.pop(version, [])
            if len(self._queued) > 2 * KEPT_QUEUED:  # forget all but the latest announced
                self._queued = dict.fromkeys(list(self._queued)[-KEPT_QUEUED:])
        for f in done:  # outside the lock: a callback may call receive() or close() the receiver
            if result is not None:
                f.set_result(result)
            else:
                f.set_exception(error)

    def stop(self) -> bool:
        """Refuse :meth:`receive` and end the sync loop; False when already stopped."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
        self._queue.put(None)
        return True

    def close(self) -> None:
        """Fail every future still waiting (ClosedError)."""
        with self._lock:
            futs = [f for waiting in self._waiters.values() for f in waiting]
            self._waiters.clear()
        for f in futs:  # outside the lock, as in settle
            f.set_exception(ClosedError("receiver closed", argument="receiver"))


def _bare(error: BaseException) -> BaseException:
    """A copy of ``error`` for later waiters, without tracebacks or chained errors: the failed
    sync's frames (its buffers, segment maps) are not kept alive by the record."""
    bare = copy.copy(error)
    bare.__traceback__, bare.__cause__, bare.__context__ = None, None, None
    return bare
