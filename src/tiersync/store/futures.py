"""Futures of store operations (save, load): a thin, typed wrapper over concurrent futures."""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Generic, TypeVar

from tiersync.store.residency import OpStatus

T = TypeVar("T")


class StoreFuture(Generic[T]):
    """Completion of one store operation. ``result()`` returns its value or raises its error."""

    def __init__(self) -> None:
        self._f: Future[T] = Future()

    @classmethod
    def completed(cls, value: T) -> StoreFuture[T]:
        f: StoreFuture[T] = cls()
        f._f.set_result(value)
        return f

    @property
    def status(self) -> OpStatus:
        if not self._f.done():
            return OpStatus.PENDING
        return OpStatus.FAILED if self._f.exception() is not None else OpStatus.DONE

    def done(self) -> bool:
        return self._f.done()

    def result(self, timeout: float | None = None) -> T:
        try:
            return self._f.result(timeout)
        except FutureTimeout:
            raise TimeoutError(f"store operation not done after {timeout} s") from None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._f.exception(timeout)

    def add_done_callback(self, fn: Callable[[StoreFuture[T]], Any]) -> None:
        self._f.add_done_callback(lambda _f: fn(self))

    def __repr__(self) -> str:
        return f"<StoreFuture {self.status.value}>"

    # -- store side ---------------------------------------------------------
    def _set(self, value: T) -> None:
        if not self._f.done():
            self._f.set_result(value)

    def _fail(self, exc: BaseException) -> None:
        if not self._f.done():
            self._f.set_exception(exc)
