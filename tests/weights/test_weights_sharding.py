"""Unit tests for meshes, shardings and shard slices."""

from __future__ import annotations

import pytest

from tiersync.errors import UsageError
from tiersync.weights import (
    Box,
    Mesh,
    Sharding,
    local_shape,
    replica_groups,
    shard_boxes,
    shard_slices,
)


def test_mesh_defaults_and_size():
    mesh = Mesh((2, 3), ("dp", "tp"))
    assert mesh.size == 6
    assert mesh.ranks == tuple(range(6))
    assert mesh.axis_size("tp") == 3
    assert dict(mesh.coords())[4] == (1, 1)


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        (dict(shape=(0,), axis_names=("a",)), "shape"),
        (dict(shape=(-1,), axis_names=("a",)), "shape"),
        (dict(shape=(2.0,), axis_names=("a",)), "shape"),
        (dict(shape=(True,), axis_names=("a",)), "shape"),
        (dict(shape=(2, 2), axis_names=("a", "a")), "axis_names"),
        (dict(shape=(2,), axis_names=("",)), "axis_names"),
        (dict(shape=(2,), axis_names=("a", "b")), "axis_names"),
        (dict(shape=(2,), axis_names="a"), "axis_names"),
        (dict(shape=(2,), axis_names=("a",), ranks=(0, 0)), "ranks"),
        (dict(shape=(2,), axis_names=("a",), ranks=(0,)), "ranks"),
        (dict(shape=(2,), axis_names=("a",), ranks=(0, -1)), "ranks"),
    ],
)
def test_mesh_rejects_bad_input(kwargs, argument):
    with pytest.raises(UsageError) as info:
        Mesh(**kwargs)
    assert info.value.argument == argument
    assert argument in str(info.value)


def test_mesh_axis_size_unknown_name():
    with pytest.raises(UsageError) as info:
        Mesh((2,), ("a",)).axis_size("b")
    assert info.value.argument == "name"


@pytest.mark.parametrize("spec", [("nope",), ("a", "a"), (("a", "b"), "a"), (3,), ((1,),)])
def test_sharding_rejects_bad_spec(spec):
    with pytest.raises(UsageError) as info:
        Sharding(Mesh((2, 2), ("a", "b")), spec)
    assert info.value.argument == "spec"


def test_sharding_rejects_non_mesh():
    with pytest.raises(UsageError) as info:
        Sharding((2, 2), ())  # type: ignore[arg-type]
    assert info.value.argument == "mesh"


def test_spec_is_normalised_and_hashable():
    mesh = Mesh((2, 2), ("a", "b"))
    s1 = Sharding(mesh, ("a", None, ["b"]))
    s2 = Sharding(mesh, (("a",), (), ("b",)))
    assert s1 == s2 and hash(s1) == hash(s2)
    assert s1.spec == (("a",), (), ("b",))


def test_uneven_remainder_goes_to_last_shard():
    mesh = Mesh((4,), ("tp",))
    slices = shard_slices((10, 3), Sharding(mesh, ("tp",)))
    assert [slices[r][0] for r in range(4)] == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 10)]
    assert all(slices[r][1] == slice(0, 3) for r in range(4))


def test_dimension_smaller_than_shard_count():
    slices = shard_slices((3,), Sharding(Mesh((4,), ("tp",)), ("tp",)))
    assert [slices[r][0] for r in range(4)] == [slice(0, 0), slice(0, 0), slice(0, 0), slice(0, 3)]


def test_multi_axis_dimension_is_major_to_minor():
    mesh = Mesh((2, 3), ("a", "b"))
    boxes = shard_boxes((12,), Sharding(mesh, (("a", "b"),)))
    # rank = a*3 + b; shard index = a*3 + b as well
    assert [boxes[r].start[0] for r in range(6)] == [0, 2, 4, 6, 8, 10]
    boxes = shard_boxes((12,), Sharding(mesh, (("b", "a"),)))
    # shard index = b*2 + a
    assert [boxes[r].start[0] for r in range(6)] == [0, 4, 8, 2, 6, 10]


def test_replicas_and_custom_ranks():
    mesh = Mesh((2, 2), ("dp", "tp"), ranks=(10, 11, 12, 13))
    sharding = Sharding(mesh, (None, "tp"))
    groups = replica_groups((4, 4), sharding)
    assert groups == {(0, 0): (10, 12), (0, 1): (11, 13)}
    assert local_shape((4, 4), sharding, 13) == (4, 2)
    with pytest.raises(UsageError) as info:
        local_shape((4, 4), sharding, 0)
    assert info.value.argument == "rank"


def test_replicated_and_scalar():
    mesh = Mesh((3,), ("x",))
    assert shard_slices((), Sharding.replicated(mesh)) == {0: (), 1: (), 2: ()}
    assert shard_slices((5,), Sharding.replicated(mesh))[2] == (slice(0, 5),)


def test_spec_longer_than_tensor_is_rejected():
    with pytest.raises(UsageError) as info:
        shard_slices((4,), Sharding(Mesh((2, 2), ("a", "b")), ("a", "b")))
    assert info.value.argument == "sharding"


@pytest.mark.parametrize("shape", [(-1,), (2.5,), "ab"])
def test_bad_shape(shape):
    with pytest.raises(UsageError) as info:
        shard_slices(shape, Sharding.replicated(Mesh((1,), ("x",))))
    assert info.value.argument == "shape"


def test_box_helpers():
    a, b = Box((0, 2), (4, 6)), Box((2, 0), (3, 3))
    assert a.intersect(b) == Box((2, 2), (3, 3))
    assert a.intersect(Box((4, 0), (5, 9))) is None
    assert Box((2, 2), (3, 3)).relative_to(a) == Box((2, 0), (3, 1))
    assert a.shape == (4, 4) and a.size == 16 and a.slices() == (slice(0, 4), slice(2, 6))
