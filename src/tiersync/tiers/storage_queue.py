"""Request combining for the storage tier: requests queued while a pass runs share the next pass.

A :class:`Combiner` keeps a FIFO of requests and at most ``max_active`` drain loops on
a thread pool. Each loop takes a *batch* from the head of the queue (``take`` decides
how much; at least one request), serves it with one call of ``serve`` and goes on
until the queue is empty. So a burst of writes becomes one segment file (one fsync)
and a burst of reads of one segment becomes one sequential pass, while a lone request
is served at once (no waiting for company). ``serve(batch)`` returns one result per
request, or an exception instance for a request that failed; if it raises, every
request of the batch gets that exception.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from typing import Generic, TypeVar

R = TypeVar("R")  # a request
T = TypeVar("T")  # its result


class Combiner(Generic[R, T]):
    """FIFO of requests served in batches by at most ``max_active`` loops on ``pool``."""

    def __init__(
        self,
        pool: Executor,
        serve: Callable[[list[R]], Sequence[T | BaseException]],
        *,
        max_active: int,
        take: Callable[[list[R]], int] | None = None,
    ) -> None:
        self._pool, self._serve, self._max = pool, serve, max_active
        # how many requests from the head
        self._take: Callable[[list[R]], int] = take if take is not None else len
        self._queue: deque[tuple[R, Future[T]]] = deque()
        self._lock = threading.Lock()
        self._active = 0

    def submit(self, request: R) -> Future[T]:
        """Queue ``request``; its future gets the result ``serve`` gave for it."""
        fut: Future[T] = Future()
        item = (request, fut)
        with self._lock:
            self._queue.append(item)
            start = self._active < self._max
            if start:
                self._active += 1
        if start:
            try:
                self._pool.submit(self._loop)
            except BaseException:  # e.g. the pool shut down: this request was never taken
                with self._lock:
                    self._active -= 1
                    for i, queued in enumerate(self._queue):
                        if queued is item:
                            del self._queue[i]
                            break
                raise
        return fut

    def _loop(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._active -= 1
                    return
                reqs = [r for r, _ in self._queue]
                n = max(1, min(self._take(reqs), len(reqs)))
                batch = [self._queue.popleft() for _ in range(n)]
            results: Sequence[T | BaseException]
            try:
                results = self._serve([r for r, _ in batch])
            except BaseException as exc:  # noqa: BLE001 - delivered through every future
                results = [exc] * len(batch)
            for (_, fut), res in zip(batch, results):
                if isinstance(res, BaseException):
                    fut.set_exception(res)
                else:
                    fut.set_result(res)
