"""PublishBuffer: GETs wait for their tensor, begin() waits for running GETs, and a GET's
release wakes waiters only when it was the last one running (begin is the only one waiting on
that count)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tiersync.errors import RemoteError
from tiersync.weights.publish_buffer import PublishBuffer


class _CountingCondition(threading.Condition):
    """A real condition that counts notify_all calls."""

    def __init__(self) -> None:
        super().__init__()
        self.wakes = 0

    def notify_all(self) -> None:
        self.wakes += 1
        super().notify_all()


def _buffer() -> tuple[PublishBuffer, _CountingCondition]:
    cond = _CountingCondition()
    sizes = [16, 32]
    return PublishBuffer(cond, None, {"a": 0, "b": 1}, [0, 16], sizes, sum(sizes)), cond


def test_a_get_waits_for_its_tensor_and_reads_what_was_written() -> None:
    buf, _ = _buffer()
    buf.begin(1, set(), 5)
    got: list[bytes] = []
    started = threading.Event()

    def get() -> None:
        started.set()
        view, release = buf.provide(1, "b", (), 30)
        got.append(bytes(view))
        release()

    t = threading.Thread(target=get)
    t.start()
    started.wait(5)
    buf.write(0, np.arange(16, dtype=np.uint8))
    buf.write(1, np.arange(32, dtype=np.uint8) + 100)
    t.join(10)
    assert got == [bytes(range(100, 132))]


def test_a_get_of_an_unwritten_tensor_gives_up_at_its_timeout() -> None:
    buf, _ = _buffer()
    buf.begin(1, set(), 5)
    with pytest.raises(RemoteError, match="not being served"):
        buf.provide(1, "a", (), 0.05)
    with pytest.raises(RemoteError, match="not being served"):
        buf.provide(2, "a", (), 0.05)  # another version


def test_only_the_last_release_wakes_waiters_and_begin_waits_for_it() -> None:
    buf, cond = _buffer()
    buf.begin(1, set(), 5)
    buf.write(0, np.zeros(16, np.uint8))
    _, first = buf.provide(1, "a", (), 5)
    _, second = buf.provide(1, "a", (), 5)
    before = cond.wakes
    first()
    assert cond.wakes == before  # one GET still runs: nobody waits for a count above zero
    began = threading.Event()
    t = threading.Thread(target=lambda: (buf.begin(2, set(), 30), began.set()))
    t.start()
    assert not began.wait(0.2)  # begin waits for the running GET
    waiting = cond.wakes  # begin's own wake-up of old GETs counted
    second()
    assert began.wait(10)
    t.join(10)
    assert cond.wakes == waiting + 1  # the last release woke begin
    with pytest.raises(RemoteError):
        buf.provide(1, "a", (), 0.05)  # the old version is no longer served
