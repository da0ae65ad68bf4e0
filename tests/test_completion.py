"""tiersync.completion: the one status and the one handle base (first settle wins, for good)."""

from __future__ import annotations

import logging
import threading

import pytest

from tiersync.completion import Completion, Status
from tiersync.disagg.config import RequestState
from tiersync.store.futures import StoreFuture
from tiersync.store.residency import OpStatus
from tiersync.transfer.future import TransferStatus


def test_every_handle_speaks_the_one_status():
    assert TransferStatus is Status and OpStatus is Status and RequestState is Status
    assert [s.value for s in Status] == ["pending", "done", "failed"]


def test_the_first_settle_wins_and_later_ones_change_nothing():
    done: Completion[int] = Completion()
    assert done.status is Status.PENDING and not done.done()
    assert done._settle(7) and not done._settle(8) and not done._fail(RuntimeError("late"))
    assert done.status is Status.DONE and done.result(0) == 7 and done.exception(0) is None
    failed: StoreFuture[int] = StoreFuture()
    error = ValueError("disk gone")
    assert failed._fail(error) and not failed._settle(1)
    assert failed.status is Status.FAILED and failed.exception(0) is error
    with pytest.raises(ValueError, match="disk gone"):
        failed.result(0)


def test_result_waits_for_another_thread_and_times_out_naming_the_operation():
    f: StoreFuture[str] = StoreFuture()
    with pytest.raises(TimeoutError, match=r"store operation not done after 0\.01 s"):
        f.result(0.01)
    started = threading.Event()

    def settle() -> None:
        started.wait(10)
        f._settle("ok")

    t = threading.Thread(target=settle)
    t.start()
    started.set()
    assert f.result(10) == "ok"
    t.join()


def test_callbacks_run_once_each_and_a_failing_one_is_logged_not_raised(caplog):
    f: Completion[int] = Completion()
    seen: list[object] = []
    f.add_done_callback(lambda h: seen.append(("first", h.result(0))))
    f.add_done_callback(lambda h: 1 / 0)
    f.add_done_callback(lambda h: seen.append(("third", h.status)))
    with caplog.at_level(logging.ERROR, logger="tiersync.completion"):
        assert f._settle(3)
    assert seen == [("first", 3), ("third", Status.DONE)]
    assert "done callback" in caplog.text and "ZeroDivisionError" in caplog.text
    f._settle(4)
    assert len(seen) == 2  # never run twice
    f.add_done_callback(lambda h: seen.append(("late", h.result(0))))  # already settled: at once
    assert seen[-1] == ("late", 3)


def test_completed_is_done_at_once():
    f = StoreFuture.completed(None)
    assert f.status is Status.DONE and f.result(0) is None
