"""One status and one completion base for everything tiersync runs in the background.

:class:`Status` is PENDING until an operation settles, then DONE or FAILED, once, for good.
:class:`Completion` is the base of every handle of such an operation (a transfer's
:class:`~tiersync.transfer.future.TransferFuture`, a store's
:class:`~tiersync.store.futures.StoreFuture`, a prefill->decode read's
:class:`~tiersync.disagg.consumer.ReadHandle`): ``status``, ``done()``, ``result(timeout)``
(the value, or the operation's error raised), ``exception(timeout)`` and
``add_done_callback(fn)`` as :class:`concurrent.futures.Future` has them. The side that runs
the operation settles it with ``_settle(value)`` or ``_fail(error)``; the first call wins and
says so. Subclasses add what their operation has (per-layer progress, arrived layers) and may
wait on :attr:`_cond`, which the base notifies when the operation settles.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable
from typing import Any, ClassVar, Generic, TypeVar

__all__ = ["Completion", "Status"]

T = TypeVar("T")
log = logging.getLogger(__name__)


class Status(enum.Enum):
    """Where one background operation stands. DONE and FAILED are final."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class Completion(Generic[T]):
    """A handle of one background operation (see the module doc). Thread-safe."""

    what: ClassVar[str] = "operation"
    """Named in the TimeoutError of :meth:`result`."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._status = Status.PENDING
        self._value: T | None = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Any], object]] = []

    @classmethod
    def completed(cls, value: T) -> Any:
        """A handle already DONE with ``value`` (for subclasses whose constructor takes no arguments)."""
        handle = cls()
        handle._settle(value)
        return handle

    @property
    def status(self) -> Status:
        return self._status

    def done(self) -> bool:
        return self._status is not Status.PENDING

    def result(self, timeout: float | None = None) -> T:
        """The value once DONE; raises the operation's error once FAILED, TimeoutError after
        ``timeout`` seconds while still PENDING."""
        self._wait(timeout)
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]  # DONE: set by _settle

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The operation's error (None when DONE); TimeoutError after ``timeout`` seconds."""
        self._wait(timeout)
        return self._error

    def add_done_callback(self, fn: Callable[[Any], object]) -> None:
        """Call ``fn(self)`` once settled (at once, on this thread, when it already is)."""
        with self._cond:
            if self._status is Status.PENDING:
                self._callbacks.append(fn)
                return
        _call(fn, self)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._status.value}>"

    # -- the side that runs the operation --------------------------------------------------
    def _settle(self, value: T) -> bool:
        """DONE with ``value``; False (and nothing changes) when already settled."""
        return self._end(Status.DONE, value, None)

    def _fail(self, error: BaseException) -> bool:
        """FAILED with ``error``; False (and nothing changes) when already settled."""
        return self._end(Status.FAILED, None, error)

    def _end(self, status: Status, value: T | None, error: BaseException | None) -> bool:
        with self._cond:
            if self._status is not Status.PENDING:
                return False
            self._on_end()
            self._value, self._error, self._status = value, error, status
            callbacks, self._callbacks = self._callbacks, []
            self._cond.notify_all()
        for fn in callbacks:
            _call(fn, self)
        return True

    def _on_end(self) -> None:
        """Runs under :attr:`_cond` just before the status becomes final (subclasses' hook)."""

    def _wait(self, timeout: float | None) -> None:
        with self._cond:
            if not self._cond.wait_for(self.done, timeout):
                raise TimeoutError(f"{self.what} not done after {timeout} s")


def _call(fn: Callable[[Any], object], handle: Completion[Any]) -> None:
    """A done callback that raises is logged and ignored (as concurrent.futures does)."""
    try:
        fn(handle)
    except Exception:
        log.exception("done callback of %r failed", handle)
