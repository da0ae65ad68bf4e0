"""Prometheus counters of the KV cache store, per tier (``host``, ``storage``).

=========================================  =========================================
metric                                     meaning
=========================================  =========================================
tiersync_store_hits_total{tier}            lookup hits, by the tier that served them
tiersync_store_misses_total                looked-up keys not returned (first miss on)
tiersync_store_evictions_total{tier}       entries dropped from a tier to make room
tiersync_store_demotions_total             host entries written down to storage
tiersync_store_promotions_total            storage entries read up into host blocks
tiersync_store_bytes_total{tier,direction} bytes written (in) / read (out) per tier
tiersync_store_corrupt_total{tier}         blocks found corrupt, never served
tiersync_store_entries{tier}               entries with a copy in the tier (gauge)
=========================================  =========================================
"""
from __future__ import annotations

from typing import Any


class StoreMetrics:
    """Store metrics in one ``prometheus_client`` registry (a private one by default)."""

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.hits = Counter("tiersync_store_hits", "Lookup hits by serving tier", ["tier"], registry=r)
        self.misses = Counter("tiersync_store_misses", "Looked-up keys not returned", registry=r)
        self.evictions = Counter("tiersync_store_evictions", "Entries evicted from a tier", ["tier"], registry=r)
        self.demotions = Counter("tiersync_store_demotions", "Host entries demoted to storage", registry=r)
        self.promotions = Counter("tiersync_store_promotions", "Storage entries promoted to host", registry=r)
        self.bytes = Counter("tiersync_store_bytes", "Bytes moved per tier", ["tier", "direction"], registry=r)
        self.corrupt = Counter("tiersync_store_corrupt", "Blocks found corrupt", ["tier"], registry=r)
        self.entries = Gauge("tiersync_store_entries", "Entries with a copy in the tier", ["tier"], registry=r)

    def value(self, name: str, **labels: str) -> float:
        """Current value of a sample, e.g. ``value("tiersync_store_hits_total", tier="host")``."""
        v = self.registry.get_sample_value(name, labels or None)
        return 0.0 if v is None else v

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
