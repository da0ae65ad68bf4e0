"""Framework tensors as host bytes, and host buffers as typed arrays.

:func:`host_bytes` gives the C-order bytes of a numpy array, torch tensor (any device:
the D2H copy happens here) or JAX array, as a flat ``uint8`` numpy array. It is a view
when the tensor is a C-contiguous host tensor and a copy otherwise. :func:`tensor_spec`
reads ``(shape, dtype name)``. :func:`allocate` makes a zeroed host array of a dtype
name (``bfloat16`` and ``float8_*`` through ``ml_dtypes`` when installed, raw bytes with a
trailing itemsize dimension otherwise). :func:`as_torch` views a host array as a torch
tensor without a copy. torch and JAX are imported only when such an object is given.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tiersync.errors import UsageError
from tiersync.weights.transfer_plan import dtype_info

__all__ = ["allocate", "as_torch", "host_bytes", "numpy_dtype", "tensor_spec"]

_TORCH_SAME_SIZE_INT = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


def _framework(tensor: Any) -> str:
    return type(tensor).__module__.split(".")[0]


def tensor_spec(tensor: Any, argument: str = "tensor") -> tuple[tuple[int, ...], str]:
    """``(shape, dtype name)`` of a numpy array, torch tensor or JAX array."""
    fw = _framework(tensor)
    if fw not in ("numpy", "torch", "jax", "jaxlib"):
        raise UsageError(
            "expected a numpy array, torch tensor or JAX array", argument=argument, got=type(tensor).__name__
        )
    name, _ = dtype_info(tensor.dtype)
    return tuple(int(s) for s in tensor.shape), name


def host_bytes(tensor: Any, argument: str = "tensor") -> np.ndarray:
    """The tensor's bytes in C order as a flat uint8 array (a view when possible)."""
    fw = _framework(tensor)
    if fw == "numpy":
        arr = np.ascontiguousarray(tensor)
    elif fw == "torch":
        arr = _torch_numpy(tensor)
    elif fw in ("jax", "jaxlib"):
        arr = np.ascontiguousarray(np.asarray(tensor))
    else:
        raise UsageError(
            "expected a numpy array, torch tensor or JAX array", argument=argument, got=type(tensor).__name__
        )
    return arr.reshape(-1).view(np.uint8)


def _torch_numpy(t: Any) -> np.ndarray:
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")  # the D2H copy
    t = t.contiguous()
    if t.dtype in (torch.bfloat16, torch.float16) or "float8" in str(t.dtype):
        t = t.view(getattr(torch, _TORCH_SAME_SIZE_INT[t.element_size()]))
    arr: np.ndarray = t.numpy()
    return arr


def numpy_dtype(name: str) -> np.dtype | None:
    """The numpy dtype of a dtype name (ml_dtypes types included), None when unknown."""
    try:
        return np.dtype(name)
    except TypeError:
        pass
    try:
        import ml_dtypes
    except ImportError:
        return None
    kind = getattr(ml_dtypes, name, None)
    return np.dtype(kind) if kind is not None else None


def allocate(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """A zeroed C-contiguous host array of ``shape`` and dtype name ``dtype``.

    Unknown to numpy and ml_dtypes: uint8 with a trailing ``itemsize`` dimension.
    """
    dt = numpy_dtype(dtype)
    if dt is None:
        _, itemsize = dtype_info(dtype)
        return np.zeros(tuple(shape) + (itemsize,), dtype=np.uint8)
    return np.zeros(tuple(shape), dtype=dt)


def as_torch(array: np.ndarray, dtype: str | None = None) -> Any:
    """A torch CPU tensor sharing ``array``'s memory (``dtype``: the logical dtype name)."""
    import torch

    name = dtype or array.dtype.name
    target = getattr(torch, name, None)
    if target is None or not isinstance(target, torch.dtype):
        raise UsageError("torch has no such dtype", argument="dtype", dtype=name)
    item = torch.empty((), dtype=target).element_size()
    raw = array.reshape(-1).view(np.uint8).view(np.dtype(_TORCH_SAME_SIZE_INT[item]))
    shape = array.shape if array.dtype != np.uint8 or name == "uint8" else array.shape[:-1]
    return torch.from_numpy(raw).view(target).reshape(shape)
