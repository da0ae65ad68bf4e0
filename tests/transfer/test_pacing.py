"""Pacing: bytes in flight and the bandwidth token bucket (tiersync.transfer.pacing).

Time is faked: the pacer's clock only moves when it sleeps, so the schedule it
computes is checked exactly and no test depends on wall-clock speed.
"""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest

from tiersync.errors import ClosedError, UsageError
from tiersync.layout.adapters import kv_layout
from tiersync.tiers.host import HostArena
from tiersync.transfer import pacing
from tiersync.transfer.engine import TransferConfig, TransferEngine
from tiersync.transfer.pacing import Pacer


class FakeClock:
    """Stands in for the ``time`` module inside pacing: sleep advances the clock."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        with self._lock:
            return self.now

    def sleep(self, s: float) -> None:
        with self._lock:
            self.sleeps.append(s)
            self.now += s


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    c = FakeClock()
    monkeypatch.setattr(pacing, "time", c)
    return c


@pytest.mark.parametrize(
    "args, argument",
    [
        ((0,), "max_inflight_bytes"),
        ((-5,), "max_inflight_bytes"),
        ((10, 0), "bandwidth_bytes_per_s"),
        ((10, -1.0), "bandwidth_bytes_per_s"),
    ],
)
def test_pacer_rejects_bad_limits(args, argument):
    with pytest.raises(UsageError) as ei:
        Pacer(*args)
    assert ei.value.argument == argument


def test_no_cap_never_sleeps(clock):
    p = Pacer(1 << 30)
    for n in (10, 10_000, 1 << 20):
        p.acquire(n)
    assert clock.sleeps == [] and p.inflight == 10 + 10_000 + (1 << 20)


def test_token_bucket_schedule_is_cumulative_bytes_over_rate(clock):
    rate = 1000.0  # bytes per second
    p = Pacer(1 << 30, rate)
    sizes = [500, 250, 1000, 250]
    for n in sizes:
        p.acquire(n)
    # chunk k starts once the bytes before it have drained at `rate`: 0, 0.5, 0.75, 1.75 s
    assert clock.sleeps == pytest.approx([0.5, 0.25, 1.0])
    assert clock.now == pytest.approx(sum(sizes[:-1]) / rate)


def test_idle_time_builds_no_burst_credit(clock):
    p = Pacer(1 << 30, 100.0)
    p.acquire(100)
    clock.now += 60.0  # a minute idle
    p.acquire(100)  # starts at once: its slot is in the past
    p.acquire(100)  # but the next still waits one chunk's worth
    assert clock.sleeps == pytest.approx([1.0])
    assert clock.now == pytest.approx(61.0)


def test_try_acquire_takes_room_only_when_acquire_would_not_wait():
    p = Pacer(100)
    assert p.try_acquire(60) and p.inflight == 60
    assert not p.try_acquire(50) and p.inflight == 60  # no room: nothing taken
    p.release(60)
    assert p.try_acquire(500) and p.inflight == 500  # alone, larger than the budget, like acquire
    p.release(500)
    assert not Pacer(100, bandwidth_bytes_per_s=1e9).try_acquire(1)  # the cap's schedule is acquire's
    p.close()
    assert not p.try_acquire(1)


def test_inflight_cap_blocks_until_release_in_order():
    p = Pacer(100)
    log: list[str] = []
    got = [threading.Event() for _ in range(3)]

    def dispatcher() -> None:
        for i in range(3):
            p.acquire(60)
            log.append(f"a{i}")
            got[i].set()

    t = threading.Thread(target=dispatcher)
    t.start()
    assert got[0].wait(10)
    for i in range(2):
        log.append(f"r{i}")  # logged before the release that lets a{i+1} in
        p.release(60)
        assert got[i + 1].wait(10)
    t.join(10)
    assert log == ["a0", "r0", "a1", "r1", "a2"]
    assert p.inflight == 60


def test_oversized_chunk_runs_alone():
    p = Pacer(100)
    p.acquire(500)  # larger than the whole budget: admitted when nothing is in flight
    assert p.inflight == 500
    p.release(500)
    p.acquire(50)
    done = threading.Event()

    def big() -> None:
        p.acquire(500)
        done.set()

    t = threading.Thread(target=big)
    t.start()
    p.release(50)  # only now may the oversized chunk go
    assert done.wait(10)
    t.join()
    assert p.inflight == 500


class CheckedPacer(Pacer):
    """Records, under the pacer's own lock, what is admitted whenever a chunk gets in."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.admitted: list[int] = []
        self.violations: list[tuple[int, list[int]]] = []
        self.peak = 0

    def acquire(self, nbytes: int) -> None:
        super().acquire(nbytes)
        with self._cv:
            self.admitted.append(nbytes)
            self.peak = max(self.peak, self._inflight)
            if self._inflight > self.max_inflight_bytes and self.admitted != [self._inflight]:
                self.violations.append((self._inflight, list(self.admitted)))

    def release(self, nbytes: int) -> None:
        with self._cv:
            self.admitted.remove(nbytes)
        super().release(nbytes)


def test_inflight_never_exceeds_cap_except_one_oversized_chunk():
    p = CheckedPacer(1000)
    rnd = random.Random(7)
    plans = [[rnd.choice([1, 100, 333, 999, 1000, 2500]) for _ in range(200)] for _ in range(4)]

    def worker(sizes: list[int]) -> None:
        for n in sizes:
            p.acquire(n)
            p.release(n)

    threads = [threading.Thread(target=worker, args=(s,)) for s in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert p.violations == []
    assert p.inflight == 0 and p.admitted == []
    assert p.peak >= 1000  # the cap was actually reached, so the check had teeth


def test_close_wakes_a_blocked_acquire_with_closed_error():
    p = Pacer(10)
    p.acquire(10)
    errors: list[BaseException] = []

    def acquire() -> None:
        with pytest.raises(ClosedError) as closed:
            p.acquire(5)
        errors.append(closed.value)

    t = threading.Thread(target=acquire)
    t.start()
    p.close()
    t.join(10)
    assert len(errors) == 1 and isinstance(errors[0], ClosedError)
    with pytest.raises(ClosedError):
        p.acquire(1)


def test_bandwidth_cap_slows_an_engine_transfer_by_the_computed_schedule(clock):
    k = np.random.default_rng(1).integers(0, 256, size=(16, 4096), dtype=np.uint8)
    layout = kv_layout([k])
    results = {}
    for cap in (None, 1e-6):  # 1e-6 GB/s = 1000 B/s on the fake clock
        clock.now, clock.sleeps = 0.0, []
        with HostArena.for_layout(layout, 16) as arena:
            eng = TransferEngine(layout, arena, TransferConfig(chunk_bytes=8192, bandwidth_gbps=cap))
            host = arena.allocate(16)
            # reversed order: 16 spans that cannot coalesce, cut into 8 chunks of 8192 B
            eng.d2h([(d, host[15 - d], 1) for d in range(16)]).result(timeout=60)
            eng.close()
            assert bytes(arena.memory[host][::-1].tobytes()) == k.tobytes()
        results[cap] = clock.now
    assert results[None] == 0.0
    # 8 chunks of 8192 B; the first goes at once, each next one after the previous drained
    assert results[1e-6] == pytest.approx(7 * 8192 / 1000.0)
