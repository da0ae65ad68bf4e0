"""RL weight synchronisation: reshard trainer weights onto sampler shards.

- :mod:`~tiersync.weights.sharding`: :class:`Mesh`, :class:`Sharding`, :class:`Box`,
  :func:`shard_slices` (who holds which N-D slice).
- :mod:`~tiersync.weights.planner`: :func:`plan_transfer` -> :class:`TransferPlan`
  (chunks, byte spans, pushers, relay trees), cached by :class:`PlanCache`.
- :mod:`~tiersync.weights.executor`: :func:`execute_local`, the in-process numpy executor.
- :mod:`~tiersync.weights.publisher` / :mod:`~tiersync.weights.receiver`: trainer -> sampler
  sync over shared memory (same host) or TCP: :class:`WeightPublisher` (one per trainer
  shard, ``publish(version)`` -> future of :class:`PublishResult`) and :class:`WeightReceiver`
  (one per sampler, ``receive(version)`` -> future, ``acquire()`` -> :class:`WeightsLease`),
  configured by :class:`PublisherConfig` / :class:`ReceiverConfig` (:class:`TransportKind`,
  ``token``, ``tls``). They speak :mod:`~tiersync.weights.ops` (the weights vocabulary) over the
  one wire stack, :mod:`tiersync.net`; :mod:`~tiersync.weights.serving` answers span GETs.
- :mod:`~tiersync.weights.delta`: delta syncs (``ReceiverConfig.delta``): a sampler fetches only
  the chunks whose trainer checksum differs from what it holds, verified after landing.

Pure Python and numpy: importing never imports torch or JAX.
"""

from tiersync.weights.buffers import WeightsLease
from tiersync.weights.config import PublisherConfig, ReceiverConfig, SyncStatus, TransportKind
from tiersync.weights.executor import allocate_destination, execute_local, span_view
from tiersync.weights.planner import PlanCache, default_plan_cache, plan_transfer
from tiersync.weights.publisher import PublishResult, SamplerOutcome, WeightPublisher
from tiersync.weights.receiver import ReceiveResult, WeightReceiver
from tiersync.weights.sharding import (
    Box,
    Mesh,
    Sharding,
    local_shape,
    replica_groups,
    shard_boxes,
    shard_slices,
)
from tiersync.weights.spans import StridedSpan, box_span
from tiersync.weights.transfer_plan import (
    PlanOptions,
    TensorSpec,
    Transfer,
    TransferKind,
    TransferPlan,
    dtype_info,
)

__all__ = [
    "Box",
    "Mesh",
    "PlanCache",
    "PlanOptions",
    "PublishResult",
    "PublisherConfig",
    "ReceiveResult",
    "ReceiverConfig",
    "SamplerOutcome",
    "Sharding",
    "StridedSpan",
    "SyncStatus",
    "TensorSpec",
    "Transfer",
    "TransferKind",
    "TransferPlan",
    "TransportKind",
    "WeightPublisher",
    "WeightReceiver",
    "WeightsLease",
    "allocate_destination",
    "box_span",
    "default_plan_cache",
    "dtype_info",
    "execute_local",
    "local_shape",
    "plan_transfer",
    "replica_groups",
    "shard_boxes",
    "shard_slices",
    "span_view",
]
