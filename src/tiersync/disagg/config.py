"""Settings, states and the polled status of the prefill -> decode transfer."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from tiersync.completion import Status
from tiersync.errors import UsageError, check_positive_int
from tiersync.net.config import Route, TcpConfig, coerce_token
from tiersync.net.frames import ProtocolConfig
from tiersync.net.tls import TlsConfig

__all__ = ["DisaggConfig", "FinishedRequests", "RequestState"]


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    """One config for both sides of a transfer (frozen, validated).

    ``timeout_s``: a request's whole life (producer: from :meth:`register` until every reader
    acknowledged; consumer: from :meth:`start_read` until every layer landed). Past it the
    request is FAILED, never done. ``connect_timeout_s``: TCP connect + handshake.
    ``io_timeout_s``: a consumer's step that should not wait — a send, the answer to a pull —
    must finish within it, so a producer that stops answering mid-read is noticed then (the
    answers that wait for the producer — the request's opening, a layer's KV_NEXT while that
    layer is computed — may take until ``timeout_s``).
    ``token``: shared secret (str or bytes, >= 16 bytes) both sides must prove; None disables
    the check (only a side without a token accepts a peer without one). ``tls``: optional
    :class:`~tiersync.net.tls.TlsConfig` (the producer needs a cert; the consumer verifies it).
    ``route``: :class:`~tiersync.net.config.Route` — AUTO reads a producer on the same host
    straight from its memory (``process_vm_readv``) and falls back to TCP when that is not
    permitted, LOCAL insists on it (the read FAILS otherwise), TCP always uses the socket.
    ``chunk_bytes``: largest piece of a layer one pull moves (<= ``protocol.max_frame_size``);
    ``window``: pulls a consumer keeps in flight per connection. ``protocol``: frame bounds
    (:class:`~tiersync.net.frames.ProtocolConfig`). ``workers``: the producer's pool answering
    pulls (a pull for a layer not yet ready holds a worker). ``local_threads``: threads a
    same-host read copies with and a producer checksums with (default: up to 4 of the cores this
    process may use). Raises UsageError naming the field.
    """

    timeout_s: float = 120.0
    connect_timeout_s: float = 5.0
    io_timeout_s: float = 30.0
    token: bytes | str | None = None
    chunk_bytes: int = 16 << 20
    sndbuf: int = 16 << 20
    rcvbuf: int = 16 << 20
    backlog: int = 128
    tls: TlsConfig | None = None
    route: Route = Route.AUTO
    window: int = 8
    workers: int = 64
    max_connections: int = 4096
    local_threads: int = field(default_factory=lambda: min(4, len(os.sched_getaffinity(0))))
    protocol: ProtocolConfig = field(default_factory=ProtocolConfig)

    def __post_init__(self) -> None:
        for name in ("timeout_s", "connect_timeout_s", "io_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise UsageError("must be > 0 seconds", argument=name, value=value)
        object.__setattr__(self, "token", coerce_token(self.token, "token"))
        for name in (
            "chunk_bytes",
            "sndbuf",
            "rcvbuf",
            "backlog",
            "window",
            "workers",
            "max_connections",
            "local_threads",
        ):
            check_positive_int(getattr(self, name), name)
        if self.tls is not None and not isinstance(self.tls, TlsConfig):
            raise UsageError("must be a TlsConfig or None", argument="tls")
        if not isinstance(self.route, Route):
            try:
                object.__setattr__(self, "route", Route(self.route))
            except ValueError:
                raise UsageError("must be a Route (auto, local, tcp)", argument="route", value=self.route) from None
        if not isinstance(self.protocol, ProtocolConfig):
            raise UsageError("must be a ProtocolConfig", argument="protocol")
        if self.chunk_bytes > self.protocol.max_frame_size - self.protocol.max_meta_size:
            raise UsageError(
                "must leave room for metadata within protocol.max_frame_size",
                argument="chunk_bytes",
                max_frame_size=self.protocol.max_frame_size,
            )

    def tcp_config(self, *, server: bool) -> TcpConfig:
        """The :class:`~tiersync.net.config.TcpConfig` of a producer (``server``) or consumer.

        A producer's pull may wait for its layer up to the request's deadline before its answer
        is written, so its per-operation deadline covers ``timeout_s``."""
        return TcpConfig(
            sndbuf=self.sndbuf,
            rcvbuf=self.rcvbuf,
            connect_timeout_s=self.connect_timeout_s,
            op_timeout_s=self.timeout_s + self.connect_timeout_s + 5.0,
            token=self.token,
            tls=self.tls,
            node_id="tiersync-kv-producer" if server else "tiersync-kv-consumer",
            backlog=self.backlog,
            max_connections=self.max_connections,
            workers=self.workers,
            route=self.route,
            local_threads=self.local_threads,
            protocol=self.protocol,
        )


RequestState = Status
"""Life of one request on either side (:class:`tiersync.completion.Status`): PENDING (producer:
registered, not every reader done; consumer: receiving), then DONE or FAILED, for good."""


@dataclass(frozen=True, slots=True)
class FinishedRequests:
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


def check_side(layout: object, rank: int, config: DisaggConfig | None) -> DisaggConfig:
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
