"""Pre-faulting host memory in the background, so a block's first copy runs at memory speed.

A fresh anonymous mapping is backed by no pages: the first write to each page traps into the
kernel, which allocates and zeroes it. Measured on a 2-core VM, a first copy into fresh
memory ran at 2-2.6 GB/s against 11-13 GB/s into the same memory once touched, and inside a
vLLM worker (one core) saving a 3000-token prompt's KV (145 MB) into a fresh host arena took
0.29-0.34 s, most of a cache miss's penalty. :class:`Prefaulter` asks the kernel to populate
the mapping (``MADV_POPULATE_WRITE``, Linux 5.14+: pages allocated, contents untouched, so it
can run while copies write into the same memory) piece by piece on a daemon thread, and stops
when told. Where the kernel lacks it, nothing happens (pages fault on first use, as before).
"""

from __future__ import annotations

import logging
import mmap
import threading

__all__ = ["Prefaulter"]

log = logging.getLogger(__name__)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # linux/mman.h
_PIECE = 32 << 20  # bytes per madvise call: a stop request waits for at most one piece


class Prefaulter:
    """Populates ``memory`` (an mmap) on a daemon thread; :meth:`stop` before closing it."""

    def __init__(self, memory: mmap.mmap, nbytes: int) -> None:
        self._memory, self._nbytes = memory, nbytes
        self._stop = threading.Event()
        self.done = threading.Event()
        """Set when every page was populated, the kernel refused, or :meth:`stop` ran."""
        self.populated = 0
        """Bytes populated so far (for tests and logs)."""
        self._thread = threading.Thread(target=self._run, name="tiersync-prefault", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for start in range(0, self._nbytes, _PIECE):
                if self._stop.is_set():
                    return
                length = min(_PIECE, self._nbytes - start)
                self._memory.madvise(MADV_POPULATE_WRITE, start, length)
                self.populated += length
        except (OSError, ValueError) as exc:  # EINVAL: kernel < 5.14; ValueError: unmapped meanwhile
            log.debug("host memory not pre-faulted (%s): pages fault on first use", exc)
        finally:
            self.done.set()

    def stop(self) -> None:
        """Stop populating and wait for the current piece; idempotent."""
        self._stop.set()
        self._thread.join()
