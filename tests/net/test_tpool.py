"""The process-wide pool of helper threads of the native same-host reader (``net/tpool.h``).

Invariants: jobs from several Python threads at once (one holds the pool, the others run on
threads of their own) each land and sum every byte exactly; a forked child, which has none of
its parent's helpers, runs its own jobs correctly.
"""

from __future__ import annotations

import os
import threading

import pytest

from _samehost_source import _expected, _ranges
from tiersync.net import local
from tiersync.transfer.kernel import TSUM64, tsum64

pytestmark = pytest.mark.skipif(
    TSUM64 is None or not local.can_read(os.getpid()), reason="needs the native checksum and process_vm_readv"
)


def test_the_helper_pool_serves_concurrent_callers_and_a_forked_child(source):
    """Copies and sums on helper threads: four Python threads at once (one holds the pool, the
    others run on threads of their own) each land and sum their ranges exactly, and a child
    forked after the pool started (it has none of the parent's helpers) sums correctly too."""
    pid, address = source
    want, ranges = _expected(), _ranges(address)
    results: dict[int, bool] = {}
    errors: list[BaseException] = []

    def reader(k: int) -> None:
        try:
            for _ in range(5):
                dests = [memoryview(bytearray(n)) for _, n in ranges]
                sums = local.read_summed(pid, ranges, dests, 3)
                results[k] = results.get(k, True) and all(
                    bytes(d) == want[a - address : a - address + n].tobytes() and got == tsum64(d)
                    for (a, n), d, got in zip(ranges, dests, sums)
                )
        except (OSError, ValueError) as exc:  # reported below: an exception in a thread would be lost
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads) and not errors and results == {0: True, 1: True, 2: True, 3: True}
    buf = want[: 8 << 20]
    child = os.fork()
    if child == 0:  # the child: exit status 0 only when its threaded sums are right
        ok = local.sum_ranges(buf, [0, 3], [8 << 20, 5 << 20], 4) == [tsum64(buf), tsum64(buf[3 : (5 << 20) + 3])]
        os._exit(0 if ok else 1)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
