"""tiersync.weights.version_queue: each announced version queued once, waiters resolved once, and
their callbacks run outside the queue's lock (a callback that closes the receiver while a control
reader announces the next version must not deadlock)."""

from __future__ import annotations

import threading

import pytest

from tiersync.errors import ClosedError, RemoteError
from tiersync.weights.config import ReceiveResult
from tiersync.weights.version_queue import Announced, VersionQueue

UP = ((7, 1),)  # one trainer shard, incarnation 7, registered once


def _at(version: int, epoch: int = 0, shards=UP) -> Announced:
    return Announced(version, epoch, shards)


def _result(version: int) -> ReceiveResult:
    return ReceiveResult(version, 8, 0.01, ())


def test_versions_queue_once_in_announce_order_and_stop_ends_the_loop():
    q = VersionQueue()
    for v in (3, 3, 5, 3):
        q.announced(_at(v))
    assert [q.next(), q.next()] == [_at(3), _at(5)]
    assert q.stop() and not q.stop()
    assert q.next() is None
    with pytest.raises(ClosedError):
        q.receive(7)


def test_waiters_resolve_once_with_the_version_or_a_later_one_or_its_error():
    q = VersionQueue()
    early, exact, later, failing = q.receive(1), q.receive(2), q.receive(4), q.receive(3)
    q.settle(2, _result(2), None)
    assert early.result(0).version == 2 and exact.result(0).version == 2 and not later.done()
    q.settle(3, None, RuntimeError("shard gone"))
    assert isinstance(failing.exception(0), RuntimeError) and not later.done()
    assert q.receive(2).result(0).version == 2  # already active: at once
    q.close()
    assert isinstance(later.exception(0), ClosedError)


def test_callbacks_run_outside_the_lock_so_another_thread_can_announce_meanwhile():
    q = VersionQueue()
    fut = q.receive(1)
    seen: list[bool] = []

    def callback(_f: object) -> None:  # as a user's callback that closes the receiver would
        announced = threading.Event()
        t = threading.Thread(target=lambda: (q.announced(_at(2)), announced.set()))
        t.start()
        seen.append(announced.wait(10))  # under the lock this would wait out the 10 s
        t.join(10)

    fut.add_done_callback(callback)
    q.settle(1, _result(1), None)
    assert seen == [True] and q.next() == _at(2)


def test_failures_are_kept_bounded_and_without_the_failed_syncs_frames():
    """A failed sync's error is kept for receive() without its traceback (whose frames held the
    sync's buffers and segment maps), and only for the latest KEPT_FAILURES versions; the
    versions announced are remembered up to a bound too."""
    import gc
    import weakref

    from tiersync.weights import version_queue as vq

    class Held:  # stands for a buffer a failed sync's frame referenced
        pass

    def failing_sync(held: Held) -> None:
        raise RuntimeError("shard gone")

    q = VersionQueue()
    held = Held()
    ref = weakref.ref(held)
    waiting = q.receive(1)
    try:
        try:
            failing_sync(held)
        except RuntimeError as inner:
            raise RuntimeError("sync of version 1 failed") from inner
    except RuntimeError as exc:
        error = exc
    del held
    q.settle(1, None, error)
    assert waiting.exception(0) is error and error.__traceback__ is not None  # a waiter gets it whole
    del error, waiting
    gc.collect()
    assert ref() is None  # the record keeps nothing of the failed sync alive (its cause's frames neither)
    later = q.receive(1).exception(0)
    assert isinstance(later, RuntimeError) and "failed" in str(later)
    for v in range(2, vq.KEPT_FAILURES + 10):
        q.settle(v, None, RuntimeError(str(v)))
    assert not q.receive(2).done()  # forgotten: waits for a later version like any other
    for v in range(3 * vq.KEPT_QUEUED):
        q.announced(_at(v))
    q.settle(10**6, _result(10**6), None)
    assert len(q._queued) <= 2 * vq.KEPT_QUEUED
    q.close()


def test_a_restarted_trainer_numbers_its_versions_again_and_each_is_synced():
    """A trainer restarted from a checkpoint (a later epoch, another incarnation) announces
    numbers the sampler saw from the process before: each is queued again, once; neither the
    failures nor the active version of the old numbering answer receive() for the new one, and
    what an old version's sync settles afterwards is not reported to the new numbering's waiters."""
    q = VersionQueue()
    for v in (1, 2, 3):
        q.announced(_at(v))
    before = q.receive(9)  # waits on the old numbering, which the restart ends
    q.settle(2, _result(2), None)
    q.settle(3, None, RuntimeError("trainer died"))
    assert isinstance(q.receive(3).exception(0), RuntimeError) and q.receive(1).result(0).version == 2
    new = ((9, 2),)
    for v in (2, 3, 3):
        q.announced(_at(v, 1, new))
    q.announced(_at(4, 0))  # a reader thread that read the epoch before the restart: no step back
    assert isinstance(before.exception(0), RemoteError) and "restarted" in str(before.exception(0))
    assert not q.receive(1).done()  # the new numbering's 1 or later: not the old 2
    assert [q.next() for _ in range(6)] == [_at(1), _at(2), _at(3), _at(2, 1, new), _at(3, 1, new), _at(4, 0)]
    waiting = q.receive(3)  # the new incarnation's 3 is coming: not the old one's failure
    q.settle(4, _result(4), None, epoch=0)  # an old version synced late: not the new numbering's 4
    q.settle(3, None, RuntimeError("old 3"), epoch=0)
    assert not waiting.done() and not q.receive(4).done()
    q.settle(3, _result(3), None, epoch=1)
    assert waiting.result(0).version == 3
    q.close()
