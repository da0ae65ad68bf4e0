"""The connector's numbers where vLLM users look: vLLM's connector stats and ``/metrics``.

Both halves of the connector count what they did since vLLM last asked
(``get_kv_connector_stats``): the scheduler the tokens it served from each tier, the worker
the bytes it moved and how long each load and save took. vLLM sums the halves and the
workers (:meth:`TierSyncStats.aggregate`), logs them with its throughput line and hands
them to :class:`TierSyncPromMetrics`, which the OpenAI server exports on ``/metrics`` beside
``vllm:external_prefix_cache_hits_total``:

=================================================  =========  =====================================
metric                                             labels     what
=================================================  =========  =====================================
``tiersync_connector_hit_tokens_total``            tier       prompt tokens loaded instead of computed
``tiersync_connector_bytes_total``                 op, tier   bytes moved: op ``load`` / ``save``
``tiersync_connector_load_errors_total``                      device blocks recomputed after a failed load
``tiersync_connector_load_seconds``  (histogram)              one step's loads (disk reads + host copies)
``tiersync_connector_save_seconds``  (histogram)              one step's device -> host copy
=================================================  =========  =====================================

``tier`` is ``host`` or ``disk``; every metric also carries vLLM's own labels (model, engine).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

__all__ = ["COUNTERS", "HISTOGRAMS", "StatsCounter", "TierSyncPromMetrics", "TierSyncStats"]

COUNTERS = (
    "hit_tokens_host",
    "hit_tokens_disk",
    "load_bytes_host",
    "load_bytes_disk",
    "save_bytes_host",
    "save_bytes_disk",
    "load_errors",
)
HISTOGRAMS = ("load_seconds", "save_seconds")
MAX_OBSERVATIONS = 4096  # per histogram and interval: vLLM asks every step, so this is never reached
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class StatsCounter:
    """What one half of the connector did since :meth:`take` last ran. Not thread-safe: each
    half counts on the thread vLLM calls it on (disk-write callbacks use :meth:`add` under
    the caller's lock)."""

    def __init__(self) -> None:
        self._data = _empty()

    def add(self, name: str, value: int) -> None:
        self._data[name] += value

    def observe(self, name: str, seconds: float) -> None:
        if len(self._data[name]) < MAX_OBSERVATIONS:
            self._data[name].append(seconds)

    def take(self) -> TierSyncStats | None:
        data, self._data = self._data, _empty()
        stats = TierSyncStats(data)
        return None if stats.is_empty() else stats


def _empty() -> dict[str, Any]:
    return {**dict.fromkeys(COUNTERS, 0), **{k: [] for k in HISTOGRAMS}}


def _normalized(data: dict[str, Any] | None) -> dict[str, Any]:
    out = _empty()
    for k in COUNTERS:
        out[k] = int((data or {}).get(k, 0))
    for k in HISTOGRAMS:
        out[k] = [float(v) for v in (data or {}).get(k, ())][:MAX_OBSERVATIONS]
    return out


class TierSyncStats(KVConnectorStats):
    """vLLM's stats container for this connector: counters are summed, observations joined."""

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        super().__init__(data=_normalized(data))

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> TierSyncStats:
        theirs = _normalized(other.data)
        for k in COUNTERS:
            self.data[k] += theirs[k]
        for k in HISTOGRAMS:
            self.data[k] = (self.data[k] + theirs[k])[:MAX_OBSERVATIONS]
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: self.data[k] for k in COUNTERS if self.data[k]}
        for k in HISTOGRAMS:
            if self.data[k]:
                out[f"{k}_mean"] = round(sum(self.data[k]) / len(self.data[k]), 6)
        return out

    def is_empty(self) -> bool:
        return not any(self.data[k] for k in COUNTERS + HISTOGRAMS)


class TierSyncPromMetrics(KVConnectorPromMetrics):
    """Registers the metrics of the module docstring and records each interval's stats."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        hits = self._counter_cls(
            name="tiersync_connector_hit_tokens_total",
            labelnames=labelnames + ["tier"],
            documentation="Prompt tokens tiersync loaded instead of vLLM computing them",
        )
        moved = self._counter_cls(
            name="tiersync_connector_bytes_total",
            labelnames=labelnames + ["op", "tier"],
            documentation="KV bytes tiersync moved (op load: into the engine, save: out)",
        )
        errors = self._counter_cls(
            name="tiersync_connector_load_errors_total",
            labelnames=labelnames,
            documentation="Device blocks recomputed because their load failed",
        )
        seconds = {
            k: self._histogram_cls(
                name=f"tiersync_connector_{k}",
                labelnames=labelnames,
                buckets=_BUCKETS,
                documentation=f"Seconds of one step's {k.split('_')[0]}s",
            )
            for k in HISTOGRAMS
        }
        self._bound: dict[int, dict[str, Any]] = {}
        for engine, values in per_engine_labelvalues.items():
            bound = {f"hit_tokens_{t}": hits.labels(*values, t) for t in ("host", "disk")}
            bound.update(
                {f"{op}_bytes_{t}": moved.labels(*values, op, t) for op in ("load", "save") for t in ("host", "disk")}
            )
            bound["load_errors"] = errors.labels(*values)
            bound.update({k: h.labels(*values) for k, h in seconds.items()})
            self._bound[engine] = bound

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        bound = self._bound.get(engine_idx)
        if bound is None:
            return
        data = _normalized(transfer_stats_data)
        for k in COUNTERS:
            if data[k]:
                bound[k].inc(data[k])
        for k in HISTOGRAMS:
            for v in data[k]:
                bound[k].observe(v)
