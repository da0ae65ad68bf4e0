"""madvise on any range of this process (tiersync.tiers.madvise): 0, or the errno refused with."""

from __future__ import annotations

import errno
import mmap

import numpy as np

from tiersync.tiers.madvise import madvise


def test_madvise_answers_zero_or_the_kernel_s_errno():
    m = mmap.mmap(-1, 4 * mmap.PAGESIZE, flags=mmap.MAP_PRIVATE)
    view = np.frombuffer(m, np.uint8)
    view[:] = 7
    address = view.ctypes.data
    assert madvise(address, len(m), mmap.MADV_DONTNEED) == 0
    assert not view.any()  # private anonymous pages dropped: they read as zeros again
    assert madvise(address + 1, mmap.PAGESIZE, mmap.MADV_DONTNEED) == errno.EINVAL  # not page-aligned
    assert madvise(address, len(m), 12345) == errno.EINVAL  # no such advice
    del view
    m.close()
