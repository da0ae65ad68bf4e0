"""Layer 7: Prometheus metrics and per-transfer timelines."""

from tiersync.telemetry.metrics import Metrics, start_exporter

__all__ = ["Metrics", "start_exporter"]
