"""Views of numpy arrays, torch tensors and JAX arrays as pools, in place.

A tensor is a pool when its major dimension is the block index. Its trailing
dimensions may be strided (a view into a padded buffer): the adapter splits a
block into the regions of live bytes, so padding is never read or written.
Nothing is copied and no framework is imported unless an object of it is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tiersync.errors import UsageError
from tiersync.layout.pool import Device, DevicePool, KVLayout, PoolSpec, Region

MAX_REGIONS = 4096
_REJECTED_KINDS = "OUSVM"  # object, str, bytes, void/structured, datetime: no fixed numeric meaning


def as_pool(tensor: Any, *, tag: str = "", layer: int = 0, argument: str = "tensor") -> DevicePool:
    """Bind ``tensor`` (numpy, torch or JAX; major dimension = block) as a pool.

    Raises :class:`UsageError` naming ``argument`` for a 0-d tensor, an
    unsupported dtype or device, negative or overlapping strides.
    """
    module = type(tensor).__module__.split(".")[0]
    if module == "numpy":
        return _from_numpy(tensor, tag, layer, argument)
    if module == "torch":
        return _from_torch(tensor, tag, layer, argument)
    if module in ("jax", "jaxlib"):
        return _from_jax(tensor, tag, layer, argument)
    raise UsageError("expected a numpy array, torch tensor or JAX array", argument=argument, got=type(tensor).__name__)


def kv_layout(layers: Sequence[Any], *, tags: Sequence[str] | None = None) -> KVLayout:
    """Build a layout from per-layer tensors.

    ``layers[l]`` is a tensor, or a tuple/list of tensors (e.g. ``(k, v)``), for
    layer ``l``. ``tags[j]`` names the j-th tensor of every layer ("k", "v").
    """
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or len(layers) == 0:
        raise UsageError("must be a non-empty sequence of per-layer tensors", argument="layers")
    if tags is not None and (isinstance(tags, (str, bytes)) or not all(isinstance(t, str) for t in tags)):
        raise UsageError(
            "must be a list of str, one per tensor of a layer (e.g. ['k', 'v'])", argument="tags", value=tags
        )
    pools = []
    for index, entry in enumerate(layers):
        group = entry if isinstance(entry, (tuple, list)) else (entry,)
        if tags is not None and len(tags) != len(group):
            raise UsageError("needs one tag per tensor of a layer", argument="tags", tags=len(tags), tensors=len(group))
        for j, t in enumerate(group):
            tag = tags[j] if tags is not None else ""
            pools.append(as_pool(t, tag=tag, layer=index, argument=f"layers[{index}][{j}]"))
    return KVLayout(tuple(pools))


def pool_from_strides(
    *,
    address: int,
    nbytes: int,
    offset: int,
    shape: Sequence[int],
    strides: Sequence[int],
    itemsize: int,
    dtype: str,
    device: Device,
    tag: str,
    layer: int,
    writable: bool,
    owner: Any,
    argument: str,
) -> DevicePool:
    """Pool of a strided view: ``offset`` bytes into a storage at ``address``; strides in bytes."""
    if len(shape) < 1:
        raise UsageError("a pool needs at least one dimension (the block index)", argument=argument)
    if any(s < 0 for s in strides):
        raise UsageError("negative strides are not supported", argument=argument, strides=tuple(strides))
    if shape[0] <= 0 or any(d <= 0 for d in shape[1:]):
        raise UsageError("every dimension must be non-empty", argument=argument, shape=tuple(shape))
    regions = _regions(tuple(shape[1:]), tuple(strides[1:]), itemsize, argument)
    stride0 = strides[0] if shape[0] > 1 else max(r.end for r in regions)
    if regions[-1].end > stride0:
        raise UsageError("blocks overlap: major stride smaller than a block", argument=argument, strides=tuple(strides))
    spec = PoolSpec(
        num_blocks=shape[0], block_stride=stride0, regions=regions, base_offset=offset, tag=tag, dtype=dtype
    )
    return DevicePool(
        spec=spec, device=device, address=address, nbytes=nbytes, layer=layer, writable=writable, owner=owner
    )


def _regions(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int, argument: str) -> tuple[Region, ...]:
    """Split one block (trailing dims) into sorted contiguous byte regions."""
    dims = [(n, s) for n, s in zip(shape, strides) if n != 1]
    run = itemsize  # bytes of the innermost contiguous chunk
    while dims and dims[-1][1] == run:
        run *= dims[-1][0]
        dims.pop()
    offsets = [0]
    for n, s in dims:
        offsets = [o + i * s for o in offsets for i in range(n)]
        if len(offsets) > MAX_REGIONS:
            raise UsageError(
                "block is split into too many strided regions; make the trailing dims contiguous",
                argument=argument,
                max_regions=MAX_REGIONS,
            )
    offsets.sort()
    merged: list[list[int]] = []
    for o in offsets:
        if merged and merged[-1][0] + merged[-1][1] > o:
            raise UsageError("trailing dimensions overlap in memory", argument=argument)
        if merged and merged[-1][0] + merged[-1][1] == o:
            merged[-1][1] += run
        else:
            merged.append([o, run])
    return tuple(Region(o, n) for o, n in merged)


def _check_dtype_kind(dtype: Any, name: str, argument: str) -> None:
    import numpy as np  # already loaded: ``dtype`` is a numpy dtype

    kind = dtype.kind
    if kind == "V" and dtype.fields is None and dtype.subdtype is None and dtype.type is not np.void:
        return  # ml_dtypes scalar types (bfloat16, float8_*): kind 'V' but fixed-size numeric
    if kind in _REJECTED_KINDS:
        raise UsageError("dtype has no fixed-size numeric layout", argument=argument, dtype=name)


def _from_numpy(a: Any, tag: str, layer: int, argument: str) -> DevicePool:
    _check_dtype_kind(a.dtype, str(a.dtype), argument)
    base = a
    while getattr(base, "base", None) is not None and hasattr(base.base, "__array_interface__"):
        base = base.base
    addr = a.__array_interface__["data"][0]
    base_addr = base.__array_interface__["data"][0] if hasattr(base, "__array_interface__") else addr
    base_nbytes = base.nbytes if hasattr(base, "nbytes") and base_addr <= addr else a.nbytes
    if base_addr > addr:
        base_addr = addr
    return pool_from_strides(
        address=base_addr,
        nbytes=base_nbytes,
        offset=addr - base_addr,
        shape=a.shape,
        strides=a.strides,
        itemsize=a.itemsize,
        dtype=str(a.dtype),
        device=Device.CPU,
        tag=tag,
        layer=layer,
        writable=bool(a.flags.writeable),
        owner=a,
        argument=argument,
    )


def _from_torch(t: Any, tag: str, layer: int, argument: str) -> DevicePool:
    kind = t.device.type
    if kind not in ("cpu", "cuda"):
        raise UsageError("torch tensors must be on cpu or cuda", argument=argument, device=str(t.device))
    if t.is_sparse or t.is_quantized:  # complex tensors are plain bytes here: allowed
        raise UsageError("sparse and quantized tensors are not supported", argument=argument)
    storage = t.untyped_storage()
    item = t.element_size()
    return pool_from_strides(
        address=storage.data_ptr(),
        nbytes=storage.nbytes(),
        offset=t.storage_offset() * item,
        shape=tuple(t.shape),
        strides=tuple(s * item for s in t.stride()),
        itemsize=item,
        dtype=str(t.dtype).removeprefix("torch."),
        device=Device.CPU if kind == "cpu" else Device.CUDA,
        tag=tag,
        layer=layer,
        writable=not t.requires_grad,
        owner=t,
        argument=argument,
    )


def _from_jax(x: Any, tag: str, layer: int, argument: str) -> DevicePool:
    devices = list(x.devices()) if hasattr(x, "devices") else []
    if len(devices) != 1 or devices[0].platform != "cpu":
        raise UsageError(
            "JAX arrays must live on exactly one CPU device (accelerator JAX pools are not supported yet)",
            argument=argument,
            devices=[str(d) for d in devices],
        )
    import numpy as np

    _check_dtype_kind(np.dtype(x.dtype), str(x.dtype), argument)
    item = np.dtype(x.dtype).itemsize
    strides, acc = [], item
    for n in reversed(x.shape):
        strides.append(acc)
        acc *= n
    return pool_from_strides(
        address=x.unsafe_buffer_pointer(),
        nbytes=x.nbytes,
        offset=0,
        shape=x.shape,
        strides=tuple(reversed(strides)),
        itemsize=item,
        dtype=str(x.dtype),
        device=Device.CPU,
        tag=tag,
        layer=layer,
        writable=True,
        owner=x,
        argument=argument,
    )
