"""Tensors viewed as pools in place (tiersync.layout.adapters)."""

from __future__ import annotations

import numpy as np
import pytest

from _isolated import run_without_leaking_jax
from tiersync.errors import UsageError
from tiersync.layout.adapters import MAX_REGIONS, as_pool, kv_layout
from tiersync.layout.pool import Device, Region

torch = pytest.importorskip("torch")


def addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


# -- numpy -------------------------------------------------------------------
def test_contiguous_numpy_pool_is_one_region_per_block():
    a = np.zeros((6, 4, 8), dtype=np.float32)
    p = as_pool(a, tag="k", layer=3)
    assert p.spec.num_blocks == 6 and p.spec.block_stride == 128
    assert p.spec.regions == (Region(0, 128),)
    assert (p.address, p.nbytes, p.spec.base_offset) == (addr(a), a.nbytes, 0)
    assert p.device is Device.CPU and p.layer == 3 and p.spec.tag == "k" and p.spec.dtype == "float32"
    assert p.writable and p.owner is a


def test_padded_trailing_dims_split_into_live_regions():
    buf = np.zeros((5, 3, 16), dtype=np.float16)  # 32 B rows, 10 live B each
    v = buf[:, :, :5]
    p = as_pool(v)
    assert p.spec.block_stride == 96
    assert p.spec.regions == (Region(0, 10), Region(32, 10), Region(64, 10))
    assert p.address == addr(buf) and p.nbytes == buf.nbytes and p.spec.base_offset == 0


def test_view_with_offset_into_base():
    buf = np.zeros((8, 64), dtype=np.uint8)
    v = buf[2:6, 16:48]
    p = as_pool(v)
    assert p.address == addr(buf) and p.nbytes == buf.nbytes
    assert p.spec.base_offset == 2 * 64 + 16
    assert p.spec.block_stride == 64 and p.spec.regions == (Region(0, 32),)
    assert p.spec.extent <= p.nbytes


def test_size_one_dims_are_ignored_and_single_block_pool():
    a = np.zeros((1, 1, 4, 1, 8), dtype=np.int8)
    p = as_pool(a)
    assert p.spec.num_blocks == 1 and p.spec.regions == (Region(0, 32),) and p.spec.block_stride == 32


def test_transposed_trailing_dims_give_sorted_item_regions():
    a = np.zeros((3, 2, 4), dtype=np.int32).transpose(0, 2, 1)  # block (4, 2) with strides (4, 16)
    p = as_pool(a)
    assert p.spec.regions == (Region(0, 32),)  # every byte of the block is live: merged


def test_bool_and_complex_are_accepted():
    assert as_pool(np.zeros((2, 3), dtype=bool)).spec.dtype == "bool"
    assert as_pool(np.zeros((2, 3), dtype=np.complex64)).spec.block_stride == 24


def test_read_only_numpy_pool_is_not_writable():
    a = np.zeros((2, 8), dtype=np.uint8)
    a.flags.writeable = False
    assert not as_pool(a).writable


@pytest.mark.parametrize(
    "a",
    [
        np.array([[object()], [object()]], dtype=object),
        np.array([["ab"], ["cd"]]),
        np.array([[b"ab"], [b"cd"]]),
        np.zeros((2, 3), dtype=[("a", "<i4"), ("b", "<f4")]),
        np.zeros((2, 3), dtype="V8"),
        np.zeros((2, 3), dtype="datetime64[ns]"),
    ],
    ids=["object", "str", "bytes", "structured", "void", "datetime"],
)
def test_non_numeric_dtypes_are_refused(a):
    with pytest.raises(UsageError) as ei:
        as_pool(a, argument="kcache")
    assert ei.value.argument == "kcache" and "dtype" in str(ei.value)


@pytest.mark.parametrize(
    "a, words",
    [
        (np.zeros((), dtype=np.float32), "dimension"),
        (np.zeros((0, 4), dtype=np.float32), "non-empty"),
        (np.zeros((4, 0), dtype=np.float32), "non-empty"),
        (np.zeros((4, 8), dtype=np.float32)[::-1], "negative"),
        (np.zeros((4, 8), dtype=np.float32)[:, ::-1], "negative"),
        (np.broadcast_to(np.zeros(8, dtype=np.float32), (4, 8)), "overlap"),
        (np.broadcast_to(np.zeros((1, 8), dtype=np.float32), (4, 2, 8)), "overlap"),
    ],
    ids=["0-d", "no-blocks", "empty-trailing", "neg-major", "neg-minor", "zero-major", "zero-minor"],
)
def test_bad_shapes_and_strides_are_refused(a, words):
    with pytest.raises(UsageError) as ei:
        as_pool(a, argument="vcache")
    assert ei.value.argument == "vcache" and words in str(ei.value)


def test_too_many_regions_is_refused():
    buf = np.zeros((2, MAX_REGIONS + 1, 2), dtype=np.uint8)
    with pytest.raises(UsageError, match="too many"):
        as_pool(buf[:, :, :1])


def test_unsupported_objects_are_refused():
    for obj in ([1, 2, 3], b"abc", memoryview(b"abcd"), 3.0):
        with pytest.raises(UsageError) as ei:
            as_pool(obj, argument="x")
        assert ei.value.argument == "x"


# -- torch -------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int8])
def test_torch_pool_geometry(dtype):
    buf = torch.zeros((4, 2, 32), dtype=dtype)
    t = buf[1:, :, :16]
    p = as_pool(t, tag="v")
    item = buf.element_size()
    assert p.address == buf.untyped_storage().data_ptr() and p.nbytes == buf.untyped_storage().nbytes()
    assert p.spec.base_offset == 64 * item and p.spec.block_stride == 64 * item
    assert p.spec.regions == (Region(0, 16 * item), Region(32 * item, 16 * item))
    assert p.spec.dtype == str(dtype).removeprefix("torch.") and p.owner is t


def test_torch_meta_and_empty_and_0d_are_refused():
    for t, words in (
        (torch.zeros((4, 8), device="meta"), "cpu or cuda"),
        (torch.zeros(()), "dimension"),
        (torch.zeros((0, 8)), "non-empty"),
    ):
        with pytest.raises(UsageError) as ei:
            as_pool(t, argument="layer0")
        assert ei.value.argument == "layer0" and words in str(ei.value)


def test_torch_sparse_is_refused():
    with pytest.raises(UsageError):
        as_pool(torch.zeros((4, 8)).to_sparse())


# -- kv_layout ---------------------------------------------------------------
def test_kv_layout_assigns_layers_and_tags():
    layers = [(np.zeros((4, 16), np.float16), np.zeros((4, 16), np.float16)) for _ in range(3)]
    lay = kv_layout(layers, tags=("k", "v"))
    assert [(p.layer, p.spec.tag) for p in lay.pools] == [(layer, t) for layer in range(3) for t in "kv"]
    assert lay.num_layers == 3 and lay.host_block_nbytes == 6 * 64  # 32 live B, aligned to 64
    single = kv_layout([np.zeros((4, 16), np.uint8)] * 2)
    assert [p.layer for p in single.pools] == [0, 1]


def test_kv_layout_refuses_bad_input():
    ok = np.zeros((4, 16), np.uint8)
    with pytest.raises(UsageError) as ei:
        kv_layout([])
    assert ei.value.argument == "layers"
    with pytest.raises(UsageError) as ei:
        kv_layout("kv")
    assert ei.value.argument == "layers"
    with pytest.raises(UsageError) as ei:
        kv_layout([(ok, ok)], tags=("k",))
    assert ei.value.argument == "tags"
    for bad_tags in ("kv", ("k", 1)):  # a str of two letters is not two tags
        with pytest.raises(UsageError) as ei:
            kv_layout([(ok, ok)], tags=bad_tags)
        assert ei.value.argument == "tags"
    with pytest.raises(UsageError) as ei:
        kv_layout([(ok, ok), (ok, np.zeros((5, 16), np.uint8))])
    assert ei.value.argument == "pools[3]"
    with pytest.raises(UsageError) as ei:
        kv_layout([(ok, np.array([[object()]] * 4))])
    assert ei.value.argument == "layers[0][1]"


# -- JAX ---------------------------------------------------------------------
def test_jax_pool_geometry_including_bfloat16():
    run_without_leaking_jax("""
        import jax.numpy as jnp
        from tiersync.errors import UsageError
        from tiersync.layout.adapters import as_pool
        from tiersync.layout.pool import Region
        for dt, item in ((jnp.float32, 4), (jnp.bfloat16, 2), (jnp.float16, 2)):
            x = jnp.zeros((4, 2, 8), dtype=dt)
            p = as_pool(x, tag="k")
            assert p.spec.num_blocks == 4 and p.spec.block_stride == 16 * item, p.spec
            assert p.spec.regions == (Region(0, 16 * item),) and p.address == x.unsafe_buffer_pointer()
        try:
            as_pool(jnp.zeros(()))
            raise SystemExit("0-d JAX array accepted")
        except UsageError:
            pass
        print("OK")
    """)
