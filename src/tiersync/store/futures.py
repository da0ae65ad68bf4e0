"""Futures of store operations (save, load): typed :class:`~tiersync.completion.Completion` handles."""

from __future__ import annotations

from typing import TypeVar

from tiersync.completion import Completion

__all__ = ["StoreFuture"]

T = TypeVar("T")


class StoreFuture(Completion[T]):
    """Completion of one store operation. ``result()`` returns its value or raises its error;
    the store settles it with ``_settle(value)`` or ``_fail(error)``."""

    what = "store operation"
