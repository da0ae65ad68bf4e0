"""Backing buffers that tiersync copies in place with transparent huge pages, in the background.

An engine's KV cache is allocated by the engine (vLLM's CPU backend: torch tensors), in 4 KiB
pages unless something asks for more. Measured on a 2-core VM, ``process_vm_readv`` (the
same-host prefill -> decode read) moved 8.2-12.1 GB/s on two threads out of torch-allocated
memory and 12.8-16.4 GB/s out of the same memory once collapsed into 2 MiB pages; collapsing
196 MB took 39-45 ms. (Torch memory given huge pages when allocated copied no faster there:
the gain is the collapse's; measure it on your host.)

:class:`Collapser` asks the kernel to collapse the 2 MiB-aligned interior of each buffer into
huge pages (``MADV_COLLAPSE``, Linux 6.1+: synchronous, contents unchanged, safe while other
threads read and write the memory: the kernel gives up on a range it cannot take, nothing
else happens), piece by piece on a daemon thread, and stops when told. ``MADV_COLLAPSE``
ignores the system-wide THP setting, so a host whose administrator set
``/sys/kernel/mm/transparent_hugepage/enabled`` to ``never`` is respected here: nothing is
collapsed. Where the kernel refuses (another OS, a kernel without it, memory marked
no-huge-pages or that it cannot collapse) nothing changes: the pages stay as they were. The
pages at either end of a buffer that share a 2 MiB range with other memory are left alone.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Sequence

import numpy as np

from tiersync.errors import UsageError

__all__ = ["HUGE_PAGE", "Collapser"]

log = logging.getLogger(__name__)
HUGE_PAGE = 2 << 20
MADV_COLLAPSE = 25  # linux/mman.h
_PIECE = 32 << 20  # bytes per madvise call: a stop request waits for at most one piece
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
_EINVAL = 22


def _interior(buffer: object, argument: str) -> tuple[int, int]:
    """(start, end) of the 2 MiB-aligned part of a C-contiguous buffer (start == end: none);
    UsageError naming ``argument`` for anything else."""
    try:
        view = np.frombuffer(buffer, np.uint8)  # type: ignore[call-overload]
    except (TypeError, ValueError, BufferError) as exc:
        raise UsageError("must be a C-contiguous buffer", argument=argument, reason=str(exc)) from None
    first, last = view.ctypes.data, view.ctypes.data + view.nbytes
    start, end = -(-first // HUGE_PAGE) * HUGE_PAGE, last // HUGE_PAGE * HUGE_PAGE
    return start, max(start, end)


class Collapser:
    """Collapses ``buffers`` (C-contiguous buffers of this process's memory that stay alive
    until :meth:`stop` returned) into huge pages on a daemon thread."""

    def __init__(self, buffers: Sequence[object]) -> None:
        self._ranges = [_interior(b, f"buffers[{i}]") for i, b in enumerate(buffers)]  # all or nothing
        self._buffers = list(buffers)  # kept alive while the thread may touch their memory
        self._stop = threading.Event()
        self.done = threading.Event()
        """Set when every range was tried, the kernel refused, or :meth:`stop` ran."""
        self.collapsed = 0
        """Bytes the kernel collapsed so far (for tests and logs)."""
        self._thread = threading.Thread(target=self._run, name="tiersync-huge-pages", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            if not sys.platform.startswith("linux") or _thp_never():
                return
            from tiersync.tiers.madvise import madvise

            for start, end in self._ranges:
                for at in range(start, end, _PIECE):
                    if self._stop.is_set():
                        return
                    n = min(_PIECE, end - at)
                    err = madvise(at, n, MADV_COLLAPSE)
                    if err == 0:
                        self.collapsed += n
                    elif err == _EINVAL:  # this kernel or this memory never will
                        log.debug("MADV_COLLAPSE refused (EINVAL) at %#x; pages left as they are", at)
                        break
        finally:
            log.debug("huge pages: %d bytes collapsed", self.collapsed)
            self._buffers = []  # the thread no longer touches them
            self.done.set()

    def stop(self) -> None:
        """Stop after the current piece and wait for the thread (the buffers may then go)."""
        self._stop.set()
        self._thread.join()


def _thp_never() -> bool:
    """The administrator turned transparent huge pages off for this host."""
    try:
        with open(_THP_ENABLED) as f:
            return "[never]" in f.read()
    except OSError:
        return False
