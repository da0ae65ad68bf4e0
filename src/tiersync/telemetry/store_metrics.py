"""Prometheus counters of the KV cache store, per tier (``host``, ``storage``) and per store.

=============================================  =========================================
metric                                         meaning
=============================================  =========================================
tiersync_store_hits_total{store,tier}          lookup hits, by the tier that served them
tiersync_store_misses_total{store}             looked-up keys not returned (first miss on)
tiersync_store_evictions_total{store,tier}     entries dropped from a tier to make room
tiersync_store_demotions_total{store}          host entries written down to storage
tiersync_store_promotions_total{store}         storage entries read up into host blocks
tiersync_store_bytes_total{store,tier,direction}  bytes written (in) / read (out) per tier
tiersync_store_corrupt_total{store,tier}       blocks found corrupt, never served
tiersync_store_entries{store,tier}             entries with a copy in the tier (gauge)
=============================================  =========================================

Every store of a process records into one set of metric families on prometheus_client's
default registry (what ``tiersync metrics`` and any exporter of the process serve), each
under its own ``store`` label (``store-1``, ``store-2``, ... unless named); :meth:`release`
removes a closed store's series. ``StoreMetrics(registry=...)`` keeps them in that registry
instead.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any

_FAMILIES = {  # name -> (kind, help, labels after "store")
    "hits": ("counter", "tiersync_store_hits", "Lookup hits by serving tier", ("tier",)),
    "misses": ("counter", "tiersync_store_misses", "Looked-up keys not returned", ()),
    "evictions": ("counter", "tiersync_store_evictions", "Entries evicted from a tier", ("tier",)),
    "demotions": ("counter", "tiersync_store_demotions", "Host entries demoted to storage", ()),
    "promotions": ("counter", "tiersync_store_promotions", "Storage entries promoted to host", ()),
    "bytes": ("counter", "tiersync_store_bytes", "Bytes moved per tier", ("tier", "direction")),
    "corrupt": ("counter", "tiersync_store_corrupt", "Blocks found corrupt", ("tier",)),
    "entries": ("gauge", "tiersync_store_entries", "Entries with a copy in the tier", ("tier",)),
}
_shared: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()  # registry -> families
_lock = threading.Lock()
_ids = itertools.count(1)


def _families(registry: Any) -> dict[str, Any]:
    from prometheus_client import Counter, Gauge

    with _lock:
        fams = _shared.get(registry)
        if fams is None:
            fams = _shared[registry] = {
                attr: (Counter if kind == "counter" else Gauge)(name, doc, ("store", *labels), registry=registry)
                for attr, (kind, name, doc, labels) in _FAMILIES.items()
            }
        return fams


class _Bound:
    """One family with the store's label filled in: ``.labels(tier, ...)``, ``.inc``, ``.set``."""

    def __init__(self, family: Any, store: str, used: set[tuple[Any, tuple[str, ...]]]) -> None:
        self._family, self._store, self._used = family, store, used

    def labels(self, *values: str) -> Any:
        self._used.add((self._family, (self._store, *values)))
        return self._family.labels(self._store, *values)

    def inc(self, amount: float = 1) -> None:
        self.labels().inc(amount)

    def set(self, value: float) -> None:
        self.labels().set(value)


class StoreMetrics:
    """One store's metrics (see the module docstring); ``store`` names its label value."""

    def __init__(self, registry: Any = None, *, store: str | None = None) -> None:
        if registry is None:
            from prometheus_client import REGISTRY as registry
        self.registry, self.store = registry, store or f"store-{next(_ids)}"
        self._used: set[tuple[Any, tuple[str, ...]]] = set()
        # one attribute per _FAMILIES entry, set below
        self.hits: _Bound
        self.misses: _Bound
        self.evictions: _Bound
        self.demotions: _Bound
        self.promotions: _Bound
        self.bytes: _Bound
        self.corrupt: _Bound
        self.entries: _Bound
        for attr, family in _families(registry).items():
            setattr(self, attr, _Bound(family, self.store, self._used))

    def value(self, name: str, **labels: str) -> float:
        """Current value of a sample of this store, e.g. ``value("tiersync_store_hits_total", tier="host")``."""
        v = self.registry.get_sample_value(name, {"store": self.store, **labels})
        return 0.0 if v is None else v

    def release(self) -> None:
        """Drop this store's series (the store closed). Idempotent."""
        for family, values in list(self._used):
            try:
                family.remove(*values)
            except KeyError:
                pass
        self._used.clear()

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
