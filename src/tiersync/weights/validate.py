"""The publisher's argument check: named local tensors and their source shardings."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tiersync.errors import UsageError
from tiersync.weights.sharding import Sharding, local_shape
from tiersync.weights.tensors import tensor_spec
from tiersync.weights.transfer_plan import TensorSpec

__all__ = ["validate_source"]


def validate_source(
    tensors: Any, layout: Any, rank: Any, global_shapes: Any
) -> tuple[list[str], list[TensorSpec], list[Sharding]]:
    """``(names, global specs, source shardings)`` in write order; UsageError naming the argument."""
    if not isinstance(tensors, Mapping) or not tensors:
        raise UsageError("expected a non-empty mapping name -> tensor", argument="tensors")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise UsageError("must be an int >= 0", argument="rank", value=rank)
    names: list[str] = []
    specs: list[TensorSpec] = []
    source: list[Sharding] = []
    for name, t in tensors.items():
        if not isinstance(name, str) or not name:
            raise UsageError("tensor names must be non-empty strings", argument="tensors", name=name)
        shape, dtype = tensor_spec(t, "tensors")
        sh = layout if isinstance(layout, Sharding) else (layout.get(name) if isinstance(layout, Mapping) else None)
        if not isinstance(sh, Sharding):
            raise UsageError(f"no Sharding for tensor {name!r}", argument="layout")
        if tuple(sh.mesh.rank_ids) != tuple(range(sh.mesh.size)) or rank >= sh.mesh.size:
            raise UsageError(
                "source meshes must number ranks 0..n-1 and hold this rank",
                argument="layout",
                rank=rank,
                ranks=sh.mesh.ranks,
            )
        if source and sh.mesh.size != source[0].mesh.size:
            raise UsageError("every source mesh must have the same size", argument="layout")
        counts = sh.shard_counts(len(shape))
        gshape = (
            tuple(global_shapes[name])
            if global_shapes and name in global_shapes
            else tuple(s * c for s, c in zip(shape, counts))
        )
        if local_shape(gshape, sh, rank) != shape:
            raise UsageError(
                f"local shape of {name!r} does not match its sharding; pass global_shapes",
                argument="global_shapes",
                local=shape,
                global_shape=gshape,
            )
        names.append(name)
        specs.append(TensorSpec(gshape, dtype))
        source.append(sh)
    return names, specs, source
