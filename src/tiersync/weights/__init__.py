"""RL weight synchronisation: reshard trainer weights onto sampler shards.

- :mod:`~tiersync.weights.sharding`: :class:`Mesh`, :class:`Sharding`, :class:`Box`,
  :func:`shard_slices` (who holds which N-D slice).
- :mod:`~tiersync.weights.planner`: :func:`plan_transfer` -> :class:`TransferPlan`
  (chunks, byte spans, pushers, relay trees), cached by :class:`PlanCache`.
- :mod:`~tiersync.weights.executor`: :func:`execute_local`, the in-process numpy executor.

Pure Python and numpy: importing never imports torch or JAX.
"""
from tiersync.weights.executor import allocate_destination, execute_local, span_view
from tiersync.weights.plan import PlanOptions, TensorSpec, Transfer, TransferKind, TransferPlan, dtype_info
from tiersync.weights.planner import PlanCache, default_plan_cache, plan_transfer
from tiersync.weights.sharding import Box, Mesh, Sharding, local_shape, replica_groups, shard_boxes, shard_slices
from tiersync.weights.spans import StridedSpan, box_span

__all__ = [
    "Box",
    "Mesh",
    "PlanCache",
    "PlanOptions",
    "Sharding",
    "StridedSpan",
    "TensorSpec",
    "Transfer",
    "TransferKind",
    "TransferPlan",
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
