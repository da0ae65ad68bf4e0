"""Collapsing buffers into transparent huge pages in the background (tiersync.tiers.huge_pages)."""

from __future__ import annotations

import mmap
import threading

import numpy as np
import pytest

from tiersync.errors import UsageError
from tiersync.tiers.huge_pages import HUGE_PAGE, Collapser


def _huge_kib(address: int) -> int:
    """AnonHugePages of the mapping holding ``address`` in this process (KiB)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


def _private(nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    """Private anonymous memory in 4 KiB pages, every page written (an engine's zeroed KV pool)."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # no madvise: as torch allocates
    view = np.frombuffer(m, np.uint8)
    view[:] = np.random.default_rng(3).integers(0, 256, nbytes, dtype=np.uint8)
    return m, view


def test_a_collapsed_buffer_keeps_every_byte_under_concurrent_writes_and_gets_huge_pages():
    m, view = _private(24 << 20)
    want = view.copy()
    stop, writes = threading.Event(), []

    def writer() -> None:  # the engine keeps writing its KV while the pages are collapsed
        i = 0
        while not stop.is_set():
            at = (i * 65_537) % view.size
            view[at] = want[at] = (i % 251) + 1
            writes.append(at)
            i += 1

    t = threading.Thread(target=writer)
    t.start()
    try:
        collapser = Collapser([view])
        assert collapser.done.wait(60)
    finally:
        stop.set()
        t.join()
    assert writes and np.array_equal(view, want)
    if collapser.collapsed == 0:
        pytest.skip("no MADV_COLLAPSE here (Linux < 6.1, or THP set to never): nothing changed, as documented")
    assert collapser.collapsed % HUGE_PAGE == 0 and collapser.collapsed >= 16 << 20
    assert _huge_kib(view.ctypes.data) * 1024 >= collapser.collapsed // 2  # the kernel may split some later
    assert len(m) == 24 << 20  # the mapping stays until the views of it go


def test_small_or_unaligned_buffers_are_left_alone_and_stop_returns_at_once():
    small = np.ones(HUGE_PAGE - 1, np.uint8)  # no whole 2 MiB range inside
    collapser = Collapser([small, memoryview(b"read-only bytes")])
    assert collapser.done.wait(30) and collapser.collapsed == 0
    m, view = _private(64 << 20)
    collapser = Collapser([view])
    collapser.stop()  # joins the thread: the buffer may go now
    assert collapser.done.is_set() and collapser.collapsed <= 64 << 20
    del view
    m.close()


def test_a_buffer_that_is_not_contiguous_memory_is_refused_by_name_before_anything_runs():
    for bad in (np.zeros((4, 4), np.uint8)[:, ::2], 42):
        with pytest.raises(UsageError) as exc:
            Collapser([np.zeros(8, np.uint8), bad])
        assert exc.value.argument == "buffers[1]"
