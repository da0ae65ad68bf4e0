"""PieceSums: a trainer shard's span checksums composed from sums taken while copying in.

Mirrors the module: every contiguous span starting on a stripe, with at least one whole piece
inside, gets exactly the tsum64 of its bytes (head, pieces, tail; the tensor's short last piece
included); other spans, a reset, or a source the kernel cannot take get None and the bytes
are still copied; the publish buffer answers only for the version and tensors written.
"""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest

from tiersync.transfer import kernel
from tiersync.weights.piece_sums import PIECE, PieceSums, span_sum
from tiersync.weights.publish_buffer import PublishBuffer
from tiersync.weights.spans import StridedSpan

pytestmark = pytest.mark.skipif(kernel.TSUM64 is None, reason="native extension not built")


def _copied(n: int, seed: int = 0) -> tuple[PieceSums, np.ndarray, np.ndarray]:
    src = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    sums, dst = PieceSums(2), np.zeros(n, np.uint8)
    sums.copy_in(1, dst, src)
    return sums, dst, src


def test_composed_sums_are_the_checksums_of_the_span_bytes():
    n = 5 * PIECE + 4097  # a short last piece
    sums, dst, src = _copied(n)
    assert np.array_equal(dst, src)
    rng = random.Random(3)
    spans = [(0, n), (0, PIECE), (PIECE, 2 * PIECE), (64, n - 64), (64, n), (3 * PIECE - 640, n), (0, 4 * PIECE + 1)]
    spans += [(64 * rng.randrange(n // 64), 0) for _ in range(40)]
    checked = 0
    for lo, hi in spans:
        hi = hi or rng.randrange(lo + 1, n + 1)
        got = span_sum(sums.of(1, n), dst, StridedSpan(lo, hi - lo))
        if got is not None:
            assert got == kernel.tsum64(memoryview(src[lo:hi])), (lo, hi)
            checked += 1
        else:  # only when no whole piece lies inside the span
            assert -(-lo // PIECE) >= (hi // PIECE if hi < n else -(-n // PIECE))
    assert checked >= 7


def test_spans_it_cannot_compose_get_none():
    sums, dst, _ = _copied(3 * PIECE)
    states = sums.of(1, 3 * PIECE)
    assert span_sum(states, dst, StridedSpan(1, 2 * PIECE)) is None  # not on a stripe
    assert span_sum(states, dst, StridedSpan(64, 1000)) is None  # no whole piece inside
    assert span_sum(states, dst, StridedSpan(0, 4096, (4,), (8192,))) is None  # strided
    assert span_sum(states, dst, StridedSpan(PIECE, 3 * PIECE)) is None  # past the tensor
    assert span_sum(sums.of(0, PIECE), dst, StridedSpan(0, PIECE)) is None  # tensor 0 never copied in
    sums.reset()
    assert sums.of(1, 3 * PIECE) is None


def test_a_tensor_copied_in_parts_keeps_the_sums_of_one_copy_and_answers_for_what_is_written():
    """Parts that start on pieces append their states: the whole tensor's equal one copy's,
    and the states of its first bytes compose the spans inside them (:meth:`PieceSums.of`)."""
    n = 5 * PIECE + 4097
    whole, _, src = _copied(n, seed=2)
    sums, dst = PieceSums(2), np.zeros(n, np.uint8)
    sums.copy_in(1, dst[: 2 * PIECE], src[: 2 * PIECE], 0)
    assert span_sum(sums.of(1, 2 * PIECE), dst[: 2 * PIECE], StridedSpan(0, 2 * PIECE)) == kernel.tsum64(
        memoryview(src[: 2 * PIECE])
    )
    sums.copy_in(1, dst[2 * PIECE :], src[2 * PIECE :], 2 * PIECE)
    assert np.array_equal(dst, src) and sums.of(1, n) == whole.of(1, n)
    assert span_sum(sums.of(1, 2 * PIECE), dst[: 2 * PIECE], StridedSpan(64, 2 * PIECE - 64)) == kernel.tsum64(
        memoryview(src[64 : 2 * PIECE])
    )  # states of more bytes than written so far are cut to them
    sums.copy_in(0, dst[:PIECE], src[:PIECE], 0)
    sums.copy_in(0, dst[PIECE + 64 : 2 * PIECE], src[PIECE + 64 : 2 * PIECE], PIECE + 64)  # not on a piece
    assert sums.of(0, 2 * PIECE) is None


def test_a_source_the_kernel_cannot_take_is_copied_without_sums():
    sums, dst = PieceSums(1), np.zeros(2 * PIECE, np.uint8)
    src = np.arange(4 * PIECE, dtype=np.uint8)[::2]  # not contiguous
    sums.copy_in(0, dst, src)
    assert np.array_equal(dst, src) and sums.of(0, 2 * PIECE) is None


def test_publish_buffer_answers_for_the_written_tensors_of_its_version():
    sizes = [2 * PIECE, PIECE + 128]
    buf = PublishBuffer(threading.Condition(), None, {"a": 0, "b": 1}, [0, sizes[0]], sizes, sum(sizes))
    rng = np.random.default_rng(5)
    data = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    whole = StridedSpan(0, sizes[0])
    buf.begin(7, set(), 1.0)
    assert buf.span_sum(7, "a", whole) is None  # not written yet
    buf.write(0, data[0])
    assert buf.span_sum(7, "a", whole) == kernel.tsum64(memoryview(data[0]))
    assert buf.span_sum(6, "a", whole) is None and buf.span_sum(7, "nope", whole) is None
    buf.write(1, data[1])
    assert buf.span_sum(7, "b", StridedSpan(0, sizes[1])) == kernel.tsum64(memoryview(data[1]))
    buf.begin(8, set(), 1.0)
    assert buf.span_sum(8, "a", whole) is None and buf.span_sum(7, "a", whole) is None


def test_a_span_is_served_once_the_parts_it_reaches_into_are_written(monkeypatch):
    """A GET of the first part of a large tensor is answered while a later part is still being
    copied; one reaching into that part waits for it (its watch wakes only once that part is
    written); its sums are known only for the written bytes."""
    from tiersync.weights.publish_buffer import PART

    size = 2 * PART + 4096
    buf = PublishBuffer(threading.Condition(), None, {"a": 0}, [0], [size], size)
    data = np.random.default_rng(6).integers(0, 256, size, dtype=np.uint8)
    buf.begin(3, set(), 1.0)
    gate, real = threading.Event(), buf._sums.copy_in

    def held(i, dst, src, lo=0):  # the second part waits for the test
        if lo >= PART:
            assert gate.wait(10)
        real(i, dst, src, lo)

    monkeypatch.setattr(buf._sums, "copy_in", held)
    writer = threading.Thread(target=buf.write, args=(0, data), daemon=True)
    writer.start()
    try:
        shard, release = _provided(buf, StridedSpan(0, PART), 10.0)
        assert np.array_equal(shard[:PART], data[:PART])
        release()
        assert buf.span_sum(3, "a", StridedSpan(0, PART)) == kernel.tsum64(memoryview(data[:PART]))
        assert buf.span_sum(3, "a", StridedSpan(0, PART + PIECE)) is None
        assert _provided(buf, StridedSpan(64, PART), 0.2) is None  # reaches 64 bytes into part 1
        woken: list[object] = []
        waiter = threading.Thread(target=lambda: woken.append(_provided(buf, StridedSpan(64, PART))), daemon=True)
        waiter.start()
        waiter.join(0.3)
        assert not woken  # it waits for part 1
        gate.set()  # part 1 is written: the waiting GET is answered, long before its 30 s
        waiter.join(10)
        assert woken and isinstance(woken[0], tuple)
        woken[0][1]()
    finally:
        gate.set()
        writer.join(10)
    shard, release = buf.provide(3, "a", (0,), None)
    assert np.array_equal(shard, data)
    release()
    assert buf.span_sum(3, "a", StridedSpan(0, size)) == kernel.tsum64(memoryview(data))


def _provided(buf: PublishBuffer, span: StridedSpan, timeout: float = 30.0) -> tuple | None:
    """``span`` of tensor "a" of version 3 as a parked GET gets it (asked again each time its
    watch wakes it); None when its watch did not wake within ``timeout`` s."""
    while not isinstance(got := buf.provide(3, "a", (0,), span), tuple):
        woken = threading.Event()
        got(woken.set)
        if not woken.wait(timeout):
            return None
    return got
