"""Prometheus metrics, named as in the reference system under a ``tiersync_`` prefix.

=========================================  =========================================
metric                                     meaning
=========================================  =========================================
tiersync_sent_bytes_total                  bytes sent to peers
tiersync_received_bytes_total              bytes received from peers
tiersync_transferred_bytes_total{direction}  bytes copied d2h / h2d
tiersync_transfer_failures_total{direction}  failed transfers
tiersync_transfer_duration_ms{direction}   wall time of one transfer (histogram)
tiersync_d2h_transfer_time_ms              device -> host copy time (histogram)
tiersync_h2d_transfer_time_ms              host -> device copy time (histogram)
tiersync_buffer_allocated_bytes            host arena bytes holding data
=========================================  =========================================

Histogram buckets run from 0.1 ms to 50 s. Nothing is exported unless
:func:`start_exporter` is called; importing this module registers nothing
until :meth:`Metrics.default` (or a constructor with a registry) is called.
"""
from __future__ import annotations

import threading
from typing import Any

BUCKETS_MS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 25000, 50000)


class Metrics:
    """A set of tiersync metrics in one ``prometheus_client`` registry."""

    _default: "Metrics | None" = None
    _default_lock = threading.Lock()

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.sent_bytes = Counter("tiersync_sent_bytes", "Bytes sent to peers", registry=r)
        self.received_bytes = Counter("tiersync_received_bytes", "Bytes received from peers", registry=r)
        self.transferred_bytes = Counter(
            "tiersync_transferred_bytes", "Bytes copied between device and host", ["direction"], registry=r)
        self.failures = Counter("tiersync_transfer_failures", "Failed transfers", ["direction"], registry=r)
        self.duration = Histogram("tiersync_transfer_duration_ms", "Transfer wall time (ms)", ["direction"],
                                  buckets=BUCKETS_MS, registry=r)
        self.d2h_time = Histogram("tiersync_d2h_transfer_time_ms", "Device to host copy time (ms)",
                                  buckets=BUCKETS_MS, registry=r)
        self.h2d_time = Histogram("tiersync_h2d_transfer_time_ms", "Host to device copy time (ms)",
                                  buckets=BUCKETS_MS, registry=r)
        self.allocated = Gauge("tiersync_buffer_allocated_bytes", "Host arena bytes holding data", registry=r)

    @classmethod
    def default(cls) -> "Metrics":
        """The process-wide metrics, registered in prometheus_client's global registry."""
        with cls._default_lock:
            if cls._default is None:
                from prometheus_client import REGISTRY

                cls._default = cls(REGISTRY)
            return cls._default

    def transfer_done(self, direction: str, nbytes: int, seconds: float) -> None:
        ms = seconds * 1e3
        self.transferred_bytes.labels(direction).inc(nbytes)
        self.duration.labels(direction).observe(ms)
        (self.d2h_time if direction == "d2h" else self.h2d_time).observe(ms)

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
