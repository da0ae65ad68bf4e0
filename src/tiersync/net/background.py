"""Answers that take long, computed off the server's workers while their session is parked.

A store node answers an OFFER at once (OFFER_REPLY), then pulls the blocks from the writer
and answers COMMIT_REPLY when the pull ends. On a server worker, a few writers that serve
their blocks slowly (or never) would hold every worker for as long as their pulls take, and
every reader of the node would wait behind them. :class:`Background` runs such a job on a
small pool of its own (jobs past its threads queue) and answers
:class:`~tiersync.net.service.Park` for it, so the session waits without a worker; when the
server asks the handler again with the same request, :meth:`Background.take` hands over the
job's answers, or parks again while it still runs. A job whose session ended runs on to its
end (it may own memory until then); its answers are dropped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor

from tiersync.errors import ClosedError
from tiersync.net.service import Park

__all__ = ["Background"]

log = logging.getLogger(__name__)

Job = Callable[[], list[object]]  # a request's remaining answers; must not raise


class Background:
    """Jobs of ``threads`` threads at most, each keyed by its (session, request id)."""

    def __init__(self, threads: int, name: str) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._jobs: dict[tuple[Hashable, int], Future[list[object]]] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._jobs)

    def start(self, session: Hashable, request_id: int, job: Job, deadline: float) -> Park:
        """Run ``job`` for ``session``'s request; the Park its session waits in meanwhile."""
        future = self._pool.submit(job)
        with self._lock:
            self._jobs[(session, request_id)] = future
        return _park(future, deadline)

    def take(self, session: Hashable, request_id: int, deadline: float) -> list[object] | Park | None:
        """The answers of the request's job once it ended (then forgotten); a Park (until
        ``deadline``) while it runs; None when the request has no job."""
        with self._lock:
            future = self._jobs.get((session, request_id))
            if future is None or not future.done():
                return None if future is None else _park(future, deadline)
            del self._jobs[(session, request_id)]
        try:
            return future.result()
        except CancelledError:  # queued when the pool closed
            raise ClosedError("closed before the answer was computed") from None
        except Exception:  # a job that broke its word: the request is answered ERROR(INTERNAL)
            log.exception("a background answer failed")
            raise

    def drop(self, session: Hashable) -> None:
        """``session`` ended: its jobs' answers are not wanted (the jobs run on)."""
        with self._lock:
            for key in [k for k in self._jobs if k[0] is session]:
                del self._jobs[key]

    def close(self) -> None:
        """Wait for the jobs running (queued ones are cancelled)."""
        self._pool.shutdown(wait=True, cancel_futures=True)


def _park(future: Future[list[object]], deadline: float) -> Park:
    return Park(lambda wake: future.add_done_callback(lambda _: wake()), deadline)
