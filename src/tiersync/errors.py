"""One exception family, split by whose fault it is.

- :class:`UsageError` — the caller passed something wrong (bad argument, wrong
  state). Also a :class:`ValueError`, so generic code can catch it as one.
- :class:`CapacityError` — the request is valid but there is no room; carries
  what was asked, what is used and what is free.
- :class:`RemoteError` — a peer (another process, host or file written by one)
  sent something wrong or went away.
- :class:`IntegrityError` — bytes failed a checksum or a header check; such
  data is never served.
- :class:`ClosedError` — the object was closed or poisoned by an earlier error
  and refuses further calls.

Every error carries ``context``: a dict of the values that explain it.
"""

from __future__ import annotations

from typing import Any


class TierSyncError(Exception):
    """Base of all tiersync errors. ``context`` holds the values behind the message."""

    def __init__(self, message: str, **context: Any) -> None:
        self.message = message
        self.context = dict(context)
        super().__init__(self._render())

    def _render(self) -> str:
        if not self.context:
            return self.message
        parts = ", ".join(f"{k}={v!r}" for k, v in self.context.items())
        return f"{self.message} ({parts})"


class UsageError(TierSyncError, ValueError):
    """The caller's fault: an invalid argument or a call in the wrong state.

    ``argument`` (when given) names the offending parameter.
    """

    def __init__(self, message: str, *, argument: str | None = None, **context: Any) -> None:
        self.argument = argument
        if argument is not None:
            message = f"{argument}: {message}"
        super().__init__(message, **context)


class CapacityError(TierSyncError):
    """Valid request, no room. ``requested``, ``used`` and ``free`` say how much."""

    def __init__(
        self,
        message: str,
        *,
        requested: int | None = None,
        used: int | None = None,
        free: int | None = None,
        **context: Any,
    ) -> None:
        self.requested, self.used, self.free = requested, used, free
        extra = {k: v for k, v in (("requested", requested), ("used", used), ("free", free)) if v is not None}
        super().__init__(message, **extra, **context)


class RemoteError(TierSyncError):
    """A peer's fault: malformed input, a refused request, a timeout or a disconnect."""

    def __init__(self, message: str, *, peer: str | None = None, **context: Any) -> None:
        self.peer = peer
        if peer is not None:
            context = {"peer": peer, **context}
        super().__init__(message, **context)


class IntegrityError(TierSyncError):
    """Stored or received bytes failed validation (magic, version, checksum, size)."""


class ClosedError(UsageError):
    """The object is closed (or failed earlier) and refuses further calls."""


def check_positive_int(value: Any, argument: str, *, allow_none: bool = False) -> None:
    """Raise :class:`UsageError` naming ``argument`` unless ``value`` is an int > 0 (bools are not ints
    here); with ``allow_none``, None passes too."""
    if allow_none and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        suffix = " or None" if allow_none else ""
        raise UsageError(f"must be a positive int{suffix}", argument=argument, value=value)
