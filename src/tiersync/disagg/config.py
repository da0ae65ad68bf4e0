"""Settings, states and the polled status of the prefill -> decode transfer."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tiersync.disagg.wire import WireLimits
from tiersync.errors import UsageError, check_positive_int

__all__ = ["DisaggConfig", "RequestState", "TransferStatus"]


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    """One config for both sides of a transfer (frozen, validated).

    ``timeout_s``: a request's whole life (producer: from :meth:`register` until every reader
    acknowledged; consumer: from :meth:`start_read` until every layer landed). Past it the
    request is FAILED, never done. ``connect_timeout_s``: TCP connect + handshake.
    ``token``: shared secret (bytes, >= 16) both sides must prove; None disables the check
    (only a side without a token accepts a peer without one). ``chunk_bytes``: largest LAYER
    payload the producer sends (<= ``limits.max_payload``). Raises UsageError naming the field.
    """

    timeout_s: float = 120.0
    connect_timeout_s: float = 5.0
    token: bytes | None = None
    chunk_bytes: int = 16 << 20
    limits: WireLimits = field(default_factory=WireLimits)
    sndbuf: int = 16 << 20
    rcvbuf: int = 16 << 20
    backlog: int = 128

    def __post_init__(self) -> None:
        for name in ("timeout_s", "connect_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise UsageError("must be > 0 seconds", argument=name, value=value)
        if self.token is not None and (not isinstance(self.token, bytes) or len(self.token) < 16):
            raise UsageError("must be bytes of at least 16 or None", argument="token")
        for name in ("chunk_bytes", "sndbuf", "rcvbuf", "backlog"):
            check_positive_int(getattr(self, name), name)
        if not isinstance(self.limits, WireLimits):
            raise UsageError("must be a WireLimits", argument="limits")
        if self.chunk_bytes > self.limits.max_payload:
            raise UsageError("must not exceed limits.max_payload", argument="chunk_bytes")


class RequestState(enum.Enum):
    """Life of one request on either side. DONE and FAILED are final."""

    PENDING = "pending"  # producer: registered, not every reader done; consumer: receiving
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class TransferStatus:
    """Requests that reached a final state since the previous poll (each reported once).

    Producer polls fill ``done_sending`` / ``failed_sending``; consumer polls fill
    ``done_receiving`` / ``failed_receiving``. A request in a final set is never touched by
    tiersync again: its source buffers are no longer read, its landing buffers never written.
    """

    done_sending: frozenset[str] = frozenset()
    failed_sending: frozenset[str] = frozenset()
    done_receiving: frozenset[str] = frozenset()
    failed_receiving: frozenset[str] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.done_sending or self.failed_sending or self.done_receiving or self.failed_receiving)


def check_side(layout: object, rank: int, config: "DisaggConfig | None") -> "DisaggConfig":
    """Validate a producer's or consumer's ``layout`` and ``rank``; returns ``config`` or the
    default. UsageError naming ``layout``, ``rank`` or ``config``."""
    from tiersync.disagg.geometry import PagedKVLayout

    if not isinstance(layout, PagedKVLayout):
        raise UsageError("must be a PagedKVLayout", argument="layout")
    layout.heads_of(rank)
    config = config if config is not None else DisaggConfig()
    if not isinstance(config, DisaggConfig):
        raise UsageError("must be a DisaggConfig", argument="config")
    return config
