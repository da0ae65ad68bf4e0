"""Pool geometry: Region, PoolSpec, DevicePool and KVLayout (tiersync.layout.pool)."""

from __future__ import annotations

import pytest

from tiersync.errors import UsageError
from tiersync.layout.pool import ALIGN, Device, DevicePool, KVLayout, PoolSpec, Region, align_up


def spec(num_blocks=4, stride=128, regions=((0, 32), (64, 32)), **kw) -> PoolSpec:
    return PoolSpec(num_blocks=num_blocks, block_stride=stride, regions=tuple(Region(o, n) for o, n in regions), **kw)


def pool(s: PoolSpec, *, layer=0, nbytes=None) -> DevicePool:
    return DevicePool(
        spec=s, device=Device.CPU, address=0x1000, nbytes=s.extent if nbytes is None else nbytes, layer=layer
    )


def test_align_up():
    assert [align_up(n) for n in (0, 1, 63, 64, 65, 128)] == [0, 64, 64, 64, 128, 128]
    assert align_up(5, 4) == 8


def test_region_end_and_spec_geometry():
    s = spec(num_blocks=4, stride=128, regions=((0, 32), (64, 32)), base_offset=16, tag="k", dtype="float16")
    assert s.regions[1].end == 96
    assert s.block_nbytes == 64
    assert s.extent == 16 + 3 * 128 + 96
    assert s.tag == "k" and s.dtype == "float16"


def test_regions_given_as_list_are_stored_as_tuple():
    s = PoolSpec(num_blocks=1, block_stride=8, regions=[Region(0, 8)])
    assert s.regions == (Region(0, 8),)


def test_describe_distinguishes_geometry_tag_and_dtype():
    base = spec()
    assert base.describe() == spec().describe()
    others = [
        spec(num_blocks=5),
        spec(stride=256),
        spec(regions=((0, 32), (64, 16))),
        spec(base_offset=8),
        spec(tag="v"),
        spec(dtype="bfloat16"),
    ]
    assert len({base.describe(), *(o.describe() for o in others)}) == 1 + len(others)


@pytest.mark.parametrize(
    "offset, nbytes, argument",
    [
        (-1, 4, "Region.offset"),
        (0.5, 4, "Region.offset"),
        (True, 4, "Region.offset"),
        ("0", 4, "Region.offset"),
        (0, 0, "Region.nbytes"),
        (0, -4, "Region.nbytes"),
        (0, 2.0, "Region.nbytes"),
        (0, True, "Region.nbytes"),
    ],
)
def test_region_rejects_bad_fields(offset, nbytes, argument):
    with pytest.raises(UsageError) as ei:
        Region(offset, nbytes)
    assert ei.value.argument == argument
    assert argument in str(ei.value)


@pytest.mark.parametrize(
    "kw, argument",
    [
        (dict(num_blocks=0), "PoolSpec.num_blocks"),
        (dict(num_blocks=-3), "PoolSpec.num_blocks"),
        (dict(num_blocks=True), "PoolSpec.num_blocks"),
        (dict(num_blocks=2.0), "PoolSpec.num_blocks"),
        (dict(block_stride=0), "PoolSpec.block_stride"),
        (dict(block_stride="64"), "PoolSpec.block_stride"),
        (dict(base_offset=-1), "PoolSpec.base_offset"),
        (dict(base_offset=1.5), "PoolSpec.base_offset"),
        (dict(tag=3), "PoolSpec.tag"),
        (dict(tag=None), "PoolSpec.tag"),
        (dict(dtype=5), "PoolSpec.dtype"),
        (dict(dtype=""), "PoolSpec.dtype"),
        (dict(regions=()), "PoolSpec.regions"),
        (dict(regions=None), "PoolSpec.regions"),
        (dict(regions="abc"), "PoolSpec.regions"),
        (dict(regions=((0, 8),)), "PoolSpec.regions"),  # tuples, not Region objects
        (dict(regions=(Region(32, 8), Region(0, 8))), "PoolSpec.regions"),  # unsorted
        (dict(regions=(Region(0, 16), Region(8, 8))), "PoolSpec.regions"),  # overlapping
        (dict(regions=(Region(0, 60), Region(60, 8))), "PoolSpec.regions"),  # past the stride
    ],
)
def test_poolspec_rejects_bad_fields(kw, argument):
    args = dict(num_blocks=2, block_stride=64, regions=(Region(0, 8),))
    args.update(kw)
    with pytest.raises(UsageError) as ei:
        PoolSpec(**args)
    assert ei.value.argument == argument


def test_regions_may_touch_and_fill_the_stride():
    s = PoolSpec(num_blocks=2, block_stride=16, regions=(Region(0, 8), Region(8, 8)))
    assert s.block_nbytes == 16 and s.extent == 32


def test_device_pool_checks_storage_size_and_layer():
    s = spec()
    assert pool(s).nbytes == s.extent
    with pytest.raises(UsageError) as ei:
        pool(s, nbytes=s.extent - 1)
    assert ei.value.argument == "spec" and ei.value.context["extent"] == s.extent
    for bad in (-1, 1.0, "0"):
        with pytest.raises(UsageError) as ei:
            pool(s, layer=bad)
        assert ei.value.argument == "layer"


def test_layout_host_image_offsets_are_aligned_and_block_major():
    a = pool(spec(regions=((0, 40),)), layer=0)  # 40 live bytes
    b = pool(spec(regions=((0, 32), (64, 32))), layer=0)  # 64 live bytes
    c = pool(spec(regions=((0, 1),)), layer=1)  # 1 live byte
    lay = KVLayout((a, b, c))
    assert lay.host_offsets == (0, 64, 128)
    assert lay.host_block_nbytes == 192
    assert all(off % ALIGN == 0 for off in lay.host_offsets)
    assert lay.block_nbytes == 105
    assert lay.num_blocks == 4 and lay.num_layers == 2
    assert lay.devices == frozenset({Device.CPU})


def test_layout_host_block_is_at_least_one_alignment_unit():
    lay = KVLayout((pool(spec(regions=((0, 1),))),))
    assert lay.host_block_nbytes == ALIGN


def test_layout_digest_depends_on_geometry_not_storage():
    s = spec(tag="k")
    d1 = KVLayout((pool(s),)).digest()
    moved = DevicePool(spec=s, device=Device.CPU, address=0x9000, nbytes=s.extent + 100)
    assert KVLayout((moved,)).digest() == d1 and len(d1) == 16
    assert KVLayout((pool(s, layer=1),)).digest() != d1
    assert KVLayout((pool(spec(tag="v")),)).digest() != d1
    assert KVLayout((pool(s), pool(s))).digest() != d1


def test_layout_rejects_empty_mixed_num_blocks_and_non_pools():
    with pytest.raises(UsageError) as ei:
        KVLayout(())
    assert ei.value.argument == "pools"
    with pytest.raises(UsageError) as ei:
        KVLayout((pool(spec(num_blocks=4)), pool(spec(num_blocks=5))))
    assert ei.value.argument == "pools[1]" and ei.value.context == {"num_blocks": 5, "expected": 4}
    for bad in ((5,), (pool(spec()), "x")):
        with pytest.raises(UsageError) as ei:
            KVLayout(bad)
        assert ei.value.argument == f"pools[{len(bad) - 1}]"
