"""PublishBuffer: a GET of bytes not written yet gets a watch woken by the write of the part it
waits for alone (its session parks meanwhile), begin() waits for running GETs and wakes the
old version's waiting ones (then refused), and a GET's release wakes the condition's waiters
only when it was the last one running (begin is the only one waiting on that count)."""

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


def _get(buf: PublishBuffer, version: int, name: str, got: dict[str, object], timeout: float = 30) -> None:
    """A GET of tensor ``name`` as the server answers it (asked again each time its watch wakes
    it): its bytes (its release kept under ``release:name``) or its error."""
    try:
        while not isinstance(answer := buf.provide(version, name, (), None), tuple):
            woken = threading.Event()
            answer(woken.set)
            if not woken.wait(timeout):
                got[name] = TimeoutError(name)
                return
        view, release = answer
        got[name], got[f"release:{name}"] = bytes(view), release
    except RemoteError as exc:
        got[name] = exc


def test_a_get_is_woken_by_its_own_tensor_and_reads_what_was_written() -> None:
    buf, cond = _buffer()
    buf.begin(1, set(), 5)
    got: dict[str, object] = {}
    threads = [threading.Thread(target=_get, args=(buf, 1, name, got)) for name in ("a", "b")]
    for t in threads:
        t.start()
    wakes = cond.wakes
    buf.write(0, np.arange(16, dtype=np.uint8))
    threads[0].join(10)
    assert got["a"] == bytes(range(16)) and "b" not in got and threads[1].is_alive()  # b's GET sleeps on
    buf.write(1, np.arange(32, dtype=np.uint8) + 100)
    threads[1].join(10)
    assert got["b"] == bytes(range(100, 132))
    assert cond.wakes == wakes  # writes wake no one waiting on the shared condition
    for name in ("a", "b"):
        got[f"release:{name}"]()


def test_begin_wakes_the_old_versions_waiting_gets_which_are_then_refused() -> None:
    buf, _ = _buffer()
    buf.begin(1, set(), 5)
    watch, woken = buf.provide(1, "a", (), None), threading.Event()
    assert callable(watch)  # not written yet: a watch, not an answer
    watch(woken.set)
    assert not woken.is_set()
    buf.begin(2, set(), 5)
    assert woken.is_set()
    with pytest.raises(RemoteError, match="not being served"):
        buf.provide(1, "a", (), None)
    late = threading.Event()
    watch(late.set)  # a watch set after its version ended wakes at once
    assert late.is_set()


def test_a_get_of_another_version_is_refused_at_once() -> None:
    buf, _ = _buffer()
    buf.begin(1, set(), 5)
    with pytest.raises(RemoteError, match="not being served"):
        buf.provide(2, "a", (), None)


def test_only_the_last_release_wakes_waiters_and_begin_waits_for_it() -> None:
    buf, cond = _buffer()
    buf.begin(1, set(), 5)
    buf.write(0, np.zeros(16, np.uint8))
    _, first = buf.provide(1, "a", (), None)
    _, second = buf.provide(1, "a", (), None)
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
        buf.provide(1, "a", (), None)  # the old version is no longer served


def test_a_get_is_woken_by_the_write_of_the_last_part_it_needs_not_an_earlier_one() -> None:
    """A GET of all of a 2-part tensor is woken once, when its second part is written (a
    100 GB shard has 25k parts of 4 MiB: each write wakes only the GETs waiting for it)."""
    from tiersync.weights.publish_buffer import PART

    sizes = [16, 2 * PART]
    buf = PublishBuffer(threading.Condition(), None, {"small": 0, "big": 1}, [0, 16], sizes, sum(sizes))
    buf.begin(1, set(), 5)
    watch = buf.provide(1, "big", (), None)
    assert callable(watch)
    answers: list[object] = []
    watch(lambda: answers.append(buf.provide(1, "big", (), None)))  # what the parked GET is asked again
    buf.write(0, np.full(16, 1, np.uint8))
    assert answers == []  # another tensor's write wakes no one
    buf.write(1, np.full(2 * PART, 7, np.uint8))
    assert len(answers) == 1 and isinstance(answers[0], tuple)  # woken once, with every byte there
    view, release = answers[0]
    assert bytes(view) == bytes([7]) * (2 * PART)
    release()


def test_a_version_refused_for_no_room_leaves_no_segment_held(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A zero-copy sampler holds version 1, so version 2 needs a new segment; /dev/shm has no
    room for it (reserve refused): the version never starts, so nobody may hold that segment
    (else each retry would leave one more behind)."""
    from tiersync.errors import CapacityError
    from tiersync.weights.segment import SEGMENT_PREFIX, SegmentPool, SegmentWriter, tensor_offsets

    offsets, payload = tensor_offsets([4096])
    pool = SegmentPool(str(tmp_path / f"{SEGMENT_PREFIX}test"), payload)
    buf = PublishBuffer(threading.Condition(), pool, {"w": 0}, offsets, [4096], payload)
    sampler = object()
    try:
        buf.begin(1, {sampler}, 5.0)
        buf.write(0, np.ones(4096, np.uint8))
        buf.complete(1)

        def no_room(self: SegmentWriter) -> None:
            raise CapacityError("no room to size shm segment", requested=payload)

        monkeypatch.setattr(SegmentWriter, "reserve", no_room)
        for version in (2, 3):  # a retry too
            with pytest.raises(CapacityError):
                buf.begin(version, {sampler}, 5.0)
            assert pool.held() == 1  # version 1's, by the sampler; not the refused one's
    finally:
        buf.close()


class _Sampler:
    def __init__(self) -> None:
        self.alive = True


def test_a_holder_dropped_while_begin_waits_holds_no_segment(tmp_path) -> None:
    """A zero-copy sampler dropped while begin() waited for the old version's GETs was already
    orphaned (nothing of the new version to retire): begin must not record it as a holder of the
    new segment, or that segment would be held, and kept in /dev/shm, for good."""
    from tiersync.weights.segment import SEGMENT_PREFIX, SegmentPool, tensor_offsets

    offsets, payload = tensor_offsets([4096])
    cond = threading.Condition()
    pool = SegmentPool(str(tmp_path / f"{SEGMENT_PREFIX}test"), payload)
    buf = PublishBuffer(cond, pool, {"w": 0}, offsets, [4096], payload)
    gone, stays = _Sampler(), _Sampler()
    try:
        buf.begin(1, {gone, stays}, 5.0)
        buf.write(0, np.ones(4096, np.uint8))
        _, release = buf.provide(1, "w", (), None)  # a GET of version 1 still running
        began = threading.Thread(target=buf.begin, args=(2, {gone, stays}, 30.0))
        began.start()  # waits for the running GET
        with cond:
            gone.alive = False  # what SamplerRegistry.drop does under the same lock
            pool.orphan(gone)
            pool.release(gone, 1)
            pool.release(stays, 1)
        release()
        began.join(10)
        assert not began.is_alive()
        with cond:
            pool.release(stays, 2)
        assert pool.held() == 0  # with the dropped sampler recorded: 1, for good
    finally:
        buf.close()
