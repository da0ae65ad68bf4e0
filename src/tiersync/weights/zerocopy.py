"""Zero-copy serving for same-host samplers: read-only views of the trainer's segment.

A tensor qualifies when every job of it reads from the same shared-memory trainer shard, each
job's source and destination spans are contiguous runs at the same distance apart, and the jobs
cover the sampler's whole local tensor: its local shard is then one contiguous run of that
shard's bytes in the segment (e.g. a replicated sampler of a one-shard trainer). Everything
else is copied as before.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from tiersync.weights.config import TransportKind
from tiersync.weights.fetch import Job
from tiersync.weights.manifest import Manifest
from tiersync.weights.segment import SegmentReader
from tiersync.weights.sharding import shard_boxes
from tiersync.weights.tensors import numpy_dtype
from tiersync.weights.transfer_plan import dtype_info

__all__ = ["zero_copy_views"]


def zero_copy_views(
    jobs: list[Job],
    manifests: list[Manifest],
    readers: Mapping[int, SegmentReader],
    local: Mapping[str, tuple[tuple[int, ...], str]],
) -> dict[str, np.ndarray]:
    """name -> read-only array (``local[name]``: shape, dtype) over the segment, for every
    qualifying tensor. ``readers``: trainer shard rank -> the mapping of this version's segment."""
    by_tensor: dict[str, list[Job]] = {}
    for j in jobs:
        by_tensor.setdefault(j.tensor, []).append(j)
    views = {}
    for name, group in by_tensor.items():
        run = _one_run(group)
        if run is None or run[0] not in readers:
            continue
        rank, delta = run
        shape, dtype = local[name]
        m = manifests[rank]
        spec = m.specs[group[0].index]
        shard_bytes = int(np.prod(shard_boxes(spec.shape, m.source[group[0].index])[rank].shape)) * spec.itemsize
        nbytes = int(np.prod(shape)) * dtype_info(dtype)[1]
        if not nbytes or delta < 0 or delta + nbytes > shard_bytes or sum(j.nbytes for j in group) != nbytes:
            continue
        raw = readers[rank].region(m.offsets[group[0].index] + delta, nbytes)
        dt = numpy_dtype(dtype)
        views[name] = raw.view(dt).reshape(shape) if dt is not None else raw.reshape(tuple(shape) + (-1,))
    return views


def _one_run(group: list[Job]) -> tuple[int, int] | None:
    """(trainer shard, source offset - destination offset) when every job is one contiguous
    run from the same SHM shard at the same distance; None otherwise."""
    found = None
    for j in group:
        if len(j.sources) != 1 or j.sources[0].via is not TransportKind.SHM:
            return None
        src = j.sources[0]
        if not (src.span.is_contiguous and j.dst_span.is_contiguous):
            return None
        key = (src.rank, src.span.offset - j.dst_span.offset)
        if found is not None and key != found:
            return None
        found = key
    return found
