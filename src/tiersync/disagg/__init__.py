"""Prefill -> decode KV transfer (layer-wise, over TCP or same-host memory) and KV resharding between TP layouts.

- :mod:`~tiersync.disagg.geometry`: :class:`PagedKVLayout` (per-layer paged KV tensor of a
  TP group: heads, head_dim, block size, dtype, :class:`KVOrder`).
- :mod:`~tiersync.disagg.reshard`: :func:`plan_reshard` / :class:`ReshardPlanner` ->
  :class:`ReshardPlan` (coalesced byte spans per (src_rank, dst_rank), layer-relative).
- :mod:`~tiersync.disagg.spanio`: :func:`gather`, :func:`scatter`, :func:`apply_plan`.
- :mod:`~tiersync.disagg.producer`: :class:`KVProducer` (prefill rank: register, layer_ready, poll).
- :mod:`~tiersync.disagg.consumer`: :class:`KVConsumer`, :class:`SourceSpec` (decode rank:
  start_read, poll); :mod:`~tiersync.disagg.read_handle`: :class:`ReadHandle` (wait_layer).
- :mod:`~tiersync.disagg.dropper`: :class:`KVDropper` (a decode scheduler, or a consumer whose
  read failed: tell prefill ranks a request will not be read, so they free its blocks now).
- :mod:`~tiersync.disagg.ops`, :mod:`~tiersync.disagg.link`: the prefill -> decode operations
  on the one tiersync wire stack (:mod:`tiersync.net`: frames, token + TLS handshake, server,
  connection pool, same-host reads) and the reader's side of one link.

Imports numpy and xxhash, never torch or JAX; ``import tiersync`` does not import this package.
"""

from tiersync.disagg.config import DisaggConfig, FinishedRequests, RequestState
from tiersync.disagg.consumer import KVConsumer, ReadHandle, SourceSpec
from tiersync.disagg.dropper import KVDropper
from tiersync.disagg.geometry import KVOrder, PagedKVLayout
from tiersync.disagg.producer import KVProducer
from tiersync.disagg.reshard import ReshardPlan, ReshardPlanner, Route, Transfer, plan_reshard
from tiersync.disagg.spanio import apply_plan, gather, scatter

__all__ = [
    "DisaggConfig",
    "FinishedRequests",
    "KVConsumer",
    "KVDropper",
    "KVOrder",
    "KVProducer",
    "PagedKVLayout",
    "ReadHandle",
    "RequestState",
    "ReshardPlan",
    "ReshardPlanner",
    "Route",
    "SourceSpec",
    "Transfer",
    "apply_plan",
    "gather",
    "plan_reshard",
    "scatter",
]
