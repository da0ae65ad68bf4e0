"""tiersync.weights.version_queue: each announced version queued once, waiters resolved once, and
their callbacks run outside the queue's lock (a callback that closes the receiver while a control
reader announces the next version must not deadlock)."""

from __future__ import annotations

import threading

import pytest

from tiersync.errors import ClosedError
from tiersync.weights.config import ReceiveResult
from tiersync.weights.version_queue import VersionQueue


def _result(version: int) -> ReceiveResult:
    return ReceiveResult(version, 8, 0.01, ())


def test_versions_queue_once_in_announce_order_and_stop_ends_the_loop():
    q = VersionQueue()
    for v in (3, 3, 5, 3):
        q.announced(v)
    assert [q.next(), q.next()] == [3, 5]
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
        t = threading.Thread(target=lambda: (q.announced(2), announced.set()))
        t.start()
        seen.append(announced.wait(10))  # under the lock this would wait out the 10 s
        t.join(10)

    fut.add_done_callback(callback)
    q.settle(1, _result(1), None)
    assert seen == [True] and q.next() == 2
