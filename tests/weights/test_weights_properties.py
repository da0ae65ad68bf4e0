"""Property tests: random shapes, dtypes, meshes and partition specs, uneven sizes included.

For every plan: each destination byte is written exactly once (checked with a coverage
counter driven by the byte spans alone), spans stay inside their buffers, relays only
forward what they already hold, and executing the plan reproduces the global tensor's
slices bit for bit.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiersync.weights import (
    Mesh,
    PlanOptions,
    Sharding,
    TransferKind,
    execute_local,
    plan_transfer,
    shard_boxes,
    shard_slices,
)

DTYPES = ["uint8", "int16", "float16", "float32", "int64", "float64", "complex64"]
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def meshes(draw, prefix):
    sizes = draw(st.lists(st.integers(1, 4), min_size=draw(st.sampled_from([0, 1, 1, 2])), max_size=3))
    while math.prod(sizes) > 16:
        sizes.pop()
    names = tuple(f"{prefix}{i}" for i in range(len(sizes)))
    ranks = None
    if draw(st.booleans()):
        ranks = tuple(draw(st.permutations(range(math.prod(sizes)))))
    return Mesh(tuple(sizes), names, ranks)


@st.composite
def shardings(draw, mesh, ndim):
    free = list(mesh.axis_names)
    spec = []
    dims = list(range(ndim))
    order = draw(st.permutations(dims))  # spread axes over inner dimensions too
    chosen: dict[int, tuple[str, ...]] = {}
    for d in order:
        k = draw(st.integers(0, min(2, len(free))))
        chosen[d] = tuple(draw(st.permutations(free))[:k]) if k else ()
        free = [a for a in free if a not in chosen[d]]
    length = draw(st.integers(0, ndim)) if draw(st.booleans()) else ndim
    for d in range(length):
        axes = chosen[d]
        spec.append(axes if len(axes) != 1 or draw(st.booleans()) else axes[0])
    return Sharding(mesh, tuple(spec))


@st.composite
def problems(draw):
    src_mesh, dst_mesh = draw(meshes("s")), draw(meshes("d"))
    tensors, src, dst = {}, {}, {}
    for i in range(draw(st.integers(1, 3))):
        shape = draw(st.lists(st.integers(1, 9), min_size=1, max_size=4))
        while math.prod(shape) > 1500:
            shape[shape.index(max(shape))] //= 2
        if draw(st.sampled_from([False] * 9 + [True])):
            shape[draw(st.integers(0, len(shape) - 1))] = 0  # an empty tensor now and then
        shape = tuple(shape)
        name = f"t{i}"
        tensors[name] = (shape, draw(st.sampled_from(DTYPES)))
        src[name] = draw(shardings(src_mesh, len(shape)))
        dst[name] = draw(shardings(dst_mesh, len(shape)))
    options = PlanOptions(
        fanout=draw(st.sampled_from([1, 2, 3, 64])),
        segment_bytes=draw(st.sampled_from([None, None, 7, 64])),
    )
    return src, dst, tensors, options


def _coverage(span, nbytes):
    """Per-byte write counts of ``span`` in a buffer of ``nbytes``, computed with numpy."""
    counter = np.zeros(nbytes, dtype=np.int32)
    offsets = np.full((1,) * len(span.counts), span.offset, dtype=np.int64)
    for axis, (count, stride) in enumerate(zip(span.counts, span.strides)):
        shape = [1] * len(span.counts)
        shape[axis] = count
        offsets = offsets + (np.arange(count) * stride).reshape(shape)
    idx = offsets.reshape(-1, 1) + np.arange(span.row_bytes)
    assert idx.min(initial=0) >= 0 and idx.max(initial=-1) < nbytes
    np.add.at(counter, idx.reshape(-1), 1)
    return counter


@SETTINGS
@given(problems())
def test_every_destination_byte_written_exactly_once(problem):
    src, dst, tensors, options = problem
    plan = plan_transfer(src, dst, tensors, options, cache=None)
    for name, spec in plan.tensors.items():
        s_boxes = shard_boxes(spec.shape, plan.source[name])
        for rank, box in shard_boxes(spec.shape, plan.destination[name]).items():
            nbytes = box.size * spec.itemsize
            counter = np.zeros(nbytes, dtype=np.int32)
            for t in plan.for_destination(rank):
                if t.tensor != name:
                    continue
                counter += _coverage(t.dst_span, nbytes)
                holder = s_boxes[t.src_rank] if t.kind is TransferKind.PUSH else box
                assert t.src_span.extent <= holder.size * spec.itemsize
                assert t.src_span.nbytes == t.dst_span.nbytes == t.global_box.size * spec.itemsize
                if options.segment_bytes is not None:  # one GET stays within the frame bound
                    assert t.nbytes <= max(options.segment_bytes, spec.itemsize)
            assert np.all(counter == 1), (name, rank)


@SETTINGS
@given(problems())
def test_relays_forward_only_what_they_hold(problem):
    src, dst, tensors, options = problem
    plan = plan_transfer(src, dst, tensors, options, cache=None)
    arrived = {(t.dst_rank, t.tensor, t.global_box): t.stage for t in plan.transfers}
    per_sender: dict = {}
    for t in plan.transfers:
        if t.kind is TransferKind.RELAY:
            assert arrived[(t.src_rank, t.tensor, t.global_box)] == t.stage - 1
        else:
            assert t.stage == 0
            box = shard_boxes(plan.tensors[t.tensor].shape, plan.source[t.tensor])[t.src_rank]
            assert box.intersect(t.global_box) == t.global_box
        key = (t.kind, t.src_rank, t.tensor, t.global_box)
        per_sender[key] = per_sender.get(key, 0) + 1
    assert all(v <= options.fanout for v in per_sender.values())


@SETTINGS
@given(problems(), st.integers(0, 2**32 - 1))
def test_execution_matches_global_slices_bitwise(problem, seed):
    src, dst, tensors, options = problem
    plan = plan_transfer(src, dst, tensors, options, cache=None)
    rng = np.random.default_rng(seed)
    globals_, src_shards = {}, {}
    for name, spec in plan.tensors.items():
        raw = rng.integers(0, 256, size=math.prod(spec.shape) * spec.itemsize, dtype=np.uint8)
        globals_[name] = raw.view(spec.dtype).reshape(spec.shape)
        for rank, sl in shard_slices(spec.shape, plan.source[name]).items():
            src_shards.setdefault(rank, {})[name] = np.ascontiguousarray(globals_[name][sl])
    out = execute_local(plan, src_shards)
    for name, spec in plan.tensors.items():
        for rank, sl in shard_slices(spec.shape, plan.destination[name]).items():
            want = np.ascontiguousarray(globals_[name][sl])
            assert out[rank][name].shape == want.shape
            assert out[rank][name].tobytes() == want.tobytes(), (name, rank)
