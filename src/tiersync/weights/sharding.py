"""Sharding descriptions: a device mesh and how each tensor dimension is split over it.

The model is JAX's ``PartitionSpec`` (or DTensor's ``Shard(d)`` / ``Replicate``):

- a :class:`Mesh` is an N-D grid of ranks with named axes, e.g. ``("dp", "tp")`` of shape
  ``(2, 4)``; mesh positions are numbered in C order and mapped to ranks (by default
  position ``i`` is rank ``i``);
- a :class:`Sharding` says, per tensor dimension, which mesh axes partition it (``None``
  = not partitioned). Mesh axes that partition no dimension replicate the tensor.

Splitting rule (the reference's): a dimension of global size ``g`` split ``n`` ways gives
shards of ``g // n`` elements; the last shard also takes the remainder ``g % n``. When
``g < n`` every shard but the last is empty. Several axes on one dimension split it
major-to-minor (the first axis named is the most significant digit of the shard index).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tiersync.errors import UsageError

__all__ = ["Box", "Mesh", "Sharding", "local_shape", "replica_groups", "shard_boxes", "shard_slices"]

DimSpec = str | Sequence[str] | None


def _check_int(value: object, argument: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(f"expected an int, got {type(value).__name__}", argument=argument, value=value)
    if value < minimum:
        raise UsageError(f"must be >= {minimum}", argument=argument, value=value)
    return value


@dataclass(frozen=True, slots=True)
class Mesh:
    """An N-D grid of ranks with named axes.

    ``shape[i]`` is the size of axis ``axis_names[i]`` (every size >= 1). ``ranks`` maps
    mesh positions, in C order, to rank ids; it defaults to ``0 .. size-1`` and must hold
    distinct non-negative ints. Raises :class:`UsageError` naming the bad argument.
    """

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    ranks: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        shape = tuple(_check_int(s, "shape", 1) for s in _as_tuple(self.shape, "shape"))
        names = _as_tuple(self.axis_names, "axis_names")
        for name in names:
            if not isinstance(name, str) or not name:
                raise UsageError("axis names must be non-empty strings", argument="axis_names", value=name)
        if len(set(names)) != len(names):
            raise UsageError("axis names must be distinct", argument="axis_names", value=names)
        if len(names) != len(shape):
            raise UsageError("needs one name per mesh axis", argument="axis_names", shape=shape, axis_names=names)
        size = math.prod(shape)
        if self.ranks is None:
            ranks = tuple(range(size))
        else:
            ranks = tuple(_check_int(r, "ranks", 0) for r in _as_tuple(self.ranks, "ranks"))
            if len(ranks) != size or len(set(ranks)) != size:
                raise UsageError(f"needs {size} distinct ranks", argument="ranks", ranks=ranks)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "axis_names", names)
        object.__setattr__(self, "ranks", ranks)

    @property
    def size(self) -> int:
        """Number of ranks in the mesh."""
        return math.prod(self.shape)

    def axis_size(self, name: str) -> int:
        """Size of axis ``name``; :class:`UsageError` if the mesh has no such axis."""
        return self.shape[self._axis_index(name, "name")]

    def _axis_index(self, name: str, argument: str = "spec") -> int:
        try:
            return self.axis_names.index(name)
        except ValueError:
            raise UsageError(f"mesh has no axis {name!r}", argument=argument, axis_names=self.axis_names) from None

    @property
    def rank_ids(self) -> tuple[int, ...]:
        """``ranks`` as the constructor filled it in (never None once built)."""
        ranks = self.ranks
        assert ranks is not None  # __post_init__ replaces None with 0 .. size-1
        return ranks

    def coords(self) -> Iterable[tuple[int, tuple[int, ...]]]:
        """Yield ``(rank, mesh coordinates)`` for every position, in C order."""
        for pos, rank in enumerate(self.rank_ids):
            yield rank, _unravel(pos, self.shape)


def _as_tuple(value: object, argument: str) -> tuple[Any, ...]:  # elements: the caller checks them
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise UsageError("expected a sequence", argument=argument, value=value)
    return tuple(value)


def _unravel(pos: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for size in reversed(shape):
        pos, rem = divmod(pos, size)
        out.append(rem)
    return tuple(reversed(out))


@dataclass(frozen=True, slots=True)
class Sharding:
    """How a tensor is laid out over ``mesh``.

    ``spec[d]`` names the mesh axes partitioning tensor dimension ``d``: ``None`` (or
    ``()``) for none, one axis name, or a tuple of names (major to minor). Each axis may
    appear at most once in the whole spec. A spec shorter than the tensor's rank leaves
    the trailing dimensions unpartitioned; a longer one is rejected when applied.
    After construction ``spec`` is normalised to a tuple of tuples of names.
    """

    mesh: Mesh
    spec: tuple[tuple[str, ...], ...] = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, Mesh):
            raise UsageError("expected a Mesh", argument="mesh", value=self.mesh)
        dims = tuple(_normalise_dim(d) for d in _as_tuple(self.spec, "spec"))
        seen: set[str] = set()
        for axes in dims:
            for name in axes:
                self.mesh._axis_index(name)
                if name in seen:
                    raise UsageError(f"mesh axis {name!r} used twice", argument="spec", spec=dims)
                seen.add(name)
        object.__setattr__(self, "spec", dims)

    @classmethod
    def replicated(cls, mesh: Mesh) -> Sharding:
        """Every rank holds the whole tensor."""
        return cls(mesh, ())

    def shard_counts(self, ndim: int) -> tuple[int, ...]:
        """Number of shards along each of ``ndim`` tensor dimensions."""
        self._check_ndim(ndim)
        sizes = dict(zip(self.mesh.axis_names, self.mesh.shape))
        return tuple(math.prod(sizes[a] for a in self._axes(d)) for d in range(ndim))

    def _axes(self, d: int) -> tuple[str, ...]:
        return self.spec[d] if d < len(self.spec) else ()

    def _check_ndim(self, ndim: int) -> None:
        if len(self.spec) > ndim:
            raise UsageError(
                f"spec has {len(self.spec)} entries for a {ndim}-D tensor", argument="sharding", spec=self.spec
            )

    def shard_index(self, coords: tuple[int, ...], ndim: int) -> tuple[int, ...]:
        """Per tensor dimension, the shard index held at mesh position ``coords``."""
        out = []
        for d in range(ndim):
            idx = 0
            for name in self._axes(d):
                a = self.mesh._axis_index(name)
                idx = idx * self.mesh.shape[a] + coords[a]
            out.append(idx)
        return tuple(out)


def _normalise_dim(entry: DimSpec) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    names = _as_tuple(entry, "spec")
    if not all(isinstance(n, str) for n in names):
        raise UsageError("spec entries must be None, an axis name or a tuple of names", argument="spec", value=entry)
    return names


@dataclass(frozen=True, slots=True)
class Box:
    """A half-open N-D box: ``start[d] <= i < stop[d]`` in every dimension ``d``."""

    start: tuple[int, ...]
    stop: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        """Extent per dimension."""
        return tuple(b - a for a, b in zip(self.start, self.stop))

    @property
    def size(self) -> int:
        """Number of elements (0 when any extent is 0)."""
        return math.prod(self.shape)

    def slices(self) -> tuple[slice, ...]:
        """The box as a tuple of slices, ready to index a numpy array."""
        return tuple(slice(a, b) for a, b in zip(self.start, self.stop))

    def intersect(self, other: Box) -> Box | None:
        """The overlap of two boxes of equal rank, or ``None`` when it holds no element."""
        start = tuple(max(a, b) for a, b in zip(self.start, other.start))
        stop = tuple(min(a, b) for a, b in zip(self.stop, other.stop))
        if any(b <= a for a, b in zip(start, stop)):
            return None
        return Box(start, stop)

    def relative_to(self, origin: Box) -> Box:
        """This box in the coordinates of ``origin`` (which should contain it)."""
        return Box(
            tuple(a - o for a, o in zip(self.start, origin.start)),
            tuple(b - o for b, o in zip(self.stop, origin.start)),
        )


def dim_intervals(size: int, n: int) -> tuple[tuple[int, int], ...]:
    """The ``n`` intervals splitting ``size`` elements: ``size // n`` each, remainder to the last."""
    step = size // n
    return tuple((i * step, size if i == n - 1 else (i + 1) * step) for i in range(n))


def _check_shape(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(_check_int(s, "shape", 0) for s in _as_tuple(shape, "shape"))


def shard_indices(shape: Sequence[int], sharding: Sharding) -> dict[int, tuple[int, ...]]:
    """Per rank, the shard index tuple (one index per tensor dimension) it holds."""
    ndim = len(_check_shape(shape))
    sharding._check_ndim(ndim)
    return {rank: sharding.shard_index(c, ndim) for rank, c in sharding.mesh.coords()}


def shard_boxes(shape: Sequence[int], sharding: Sharding) -> dict[int, Box]:
    """Per rank, the :class:`Box` of the global tensor it holds (in global coordinates)."""
    shape = _check_shape(shape)
    intervals = [dim_intervals(s, n) for s, n in zip(shape, sharding.shard_counts(len(shape)))]
    out = {}
    for rank, idx in shard_indices(shape, sharding).items():
        parts = [intervals[d][i] for d, i in enumerate(idx)]
        out[rank] = Box(tuple(p[0] for p in parts), tuple(p[1] for p in parts))
    return out


def shard_slices(shape: Sequence[int], sharding: Sharding) -> dict[int, tuple[slice, ...]]:
    """Per rank, the N-D slices of the global tensor it holds; equal slices are replicas."""
    return {rank: box.slices() for rank, box in shard_boxes(shape, sharding).items()}


def local_shape(shape: Sequence[int], sharding: Sharding, rank: int) -> tuple[int, ...]:
    """Shape of ``rank``'s local shard; :class:`UsageError` if the mesh has no such rank."""
    boxes = shard_boxes(shape, sharding)
    if rank not in boxes:
        raise UsageError("rank not in mesh", argument="rank", rank=rank)
    return boxes[rank].shape


def replica_groups(shape: Sequence[int], sharding: Sharding) -> dict[tuple[int, ...], tuple[int, ...]]:
    """Shard index tuple -> ranks holding that shard (sorted). Every index tuple occurs."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank, idx in shard_indices(shape, sharding).items():
        groups.setdefault(idx, []).append(rank)
    return {idx: tuple(sorted(r)) for idx, r in groups.items()}
