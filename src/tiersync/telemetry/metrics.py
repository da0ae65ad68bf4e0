"""Prometheus metrics of the transfer engine and the host arenas, Prometheus-style names.

=============================================  ==============================================
metric                                         meaning
=============================================  ==============================================
tiersync_transferred_bytes_total{direction}    bytes copied d2h / h2d
tiersync_transfer_failures_total{direction}    failed transfers
tiersync_transfer_seconds{direction}           wall time of one transfer (histogram)
tiersync_buffer_allocated_bytes                host arena bytes holding data, every live arena
=============================================  ==============================================

The reference system's ``d2h_transfer_time_ms`` / ``h2d_transfer_time_ms`` are
``tiersync_transfer_seconds{direction="d2h"|"h2d"}`` (seconds, as Prometheus names a time);
no duplicate series are kept for them. Every ``TransferEngine`` records into
:meth:`Metrics.default` (prometheus_client's default registry) unless given other metrics,
and every ``HostArena`` counts in the allocated-bytes gauge while it is open; the KV cache
store's metrics (:mod:`tiersync.telemetry.store_metrics`) are on the same registry. Importing
this module registers nothing: the default set is created on first use.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

BUCKETS_S = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50)
_ARENAS: weakref.WeakSet[Any] = weakref.WeakSet()  # open arenas, for the allocated-bytes gauge


def track_arena(arena: Any) -> None:
    """Count ``arena`` (anything with ``allocated_bytes()``) in the gauge while it lives."""
    _ARENAS.add(arena)


def untrack_arena(arena: Any) -> None:
    _ARENAS.discard(arena)


def _allocated() -> float:
    return float(sum(a.allocated_bytes() for a in list(_ARENAS)))


class Metrics:
    """A set of tiersync metrics in one ``prometheus_client`` registry."""

    _default: Metrics | None = None
    _default_lock = threading.Lock()

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.transferred_bytes = Counter(
            "tiersync_transferred_bytes", "Bytes copied between device and host", ["direction"], registry=r
        )
        self.failures = Counter("tiersync_transfer_failures", "Failed transfers", ["direction"], registry=r)
        self.duration = Histogram(
            "tiersync_transfer_seconds", "Wall time of one transfer", ["direction"], buckets=BUCKETS_S, registry=r
        )
        self.allocated = Gauge("tiersync_buffer_allocated_bytes", "Host arena bytes holding data", registry=r)
        self.allocated.set_function(_allocated)

    @classmethod
    def default(cls) -> Metrics:
        """The process-wide metrics, registered in prometheus_client's global registry."""
        with cls._default_lock:
            if cls._default is None:
                from prometheus_client import REGISTRY

                cls._default = cls(REGISTRY)
            return cls._default

    def transfer_done(self, direction: str, nbytes: int, seconds: float) -> None:
        self.transferred_bytes.labels(direction).inc(nbytes)
        self.duration.labels(direction).observe(seconds)

    def transfer_failed(self, direction: str) -> None:
        self.failures.labels(direction).inc()

    def render(self) -> bytes:
        """The metrics in Prometheus text format."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


def start_exporter(port: int, *, addr: str = "127.0.0.1", metrics: Metrics | None = None) -> Any:
    """Serve ``/metrics`` over HTTP on ``addr:port`` (0 picks a free port). Returns the server."""
    from prometheus_client import start_http_server

    m = metrics or Metrics.default()
    server, _thread = start_http_server(port, addr=addr, registry=m.registry)
    return server
