"""Shared pieces of the weight-sync tests: a model, its shards and the bitwise check.

Only numpy dtypes here (no bfloat16): importing ml_dtypes in the pytest process would
register bfloat16 with numpy for every later test; bf16 runs in subprocesses.
"""

from __future__ import annotations

import numpy as np
import xxhash

from tiersync.weights import Mesh, Sharding, shard_slices


def model(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "embed": rng.standard_normal((37, 24)).astype(np.float32),
        "layer0.w": rng.integers(-1000, 1000, (16, 12, 5)).astype(np.int32),
        "layer0.norm": rng.standard_normal(24).astype(np.float64),
        "head": rng.standard_normal((24, 37)).astype(np.float16),
    }


def fsdp(n: int) -> Sharding:
    return Sharding(Mesh((n,), ("fsdp",)), ("fsdp",))


def shards_of(g: dict[str, np.ndarray], layout, rank: int) -> dict[str, np.ndarray]:
    """Rank ``rank``'s local shards (C-contiguous copies) of ``g``."""
    out = {}
    for name, a in g.items():
        sh = layout[name] if isinstance(layout, dict) else layout
        out[name] = np.ascontiguousarray(a[shard_slices(a.shape, sh)[rank]])
    return out


def tp_dp_layout(g: dict[str, np.ndarray], tp: int = 2, dp: int = 3) -> dict[str, Sharding]:
    """Tensor-parallel on the last dimension, replicated over dp (each dp replica a sampler)."""
    mesh = Mesh((tp, dp), ("tp", "dp"))
    return {n: Sharding(mesh, (None,) * (a.ndim - 1) + ("tp",)) for n, a in g.items()}


def assert_bitwise(lease_tensors: dict[str, np.ndarray], g: dict[str, np.ndarray], layout, rank: int) -> None:
    want = shards_of(g, layout, rank)
    assert set(lease_tensors) == set(want)
    for name, a in want.items():
        got = lease_tensors[name]
        assert got.shape == a.shape and got.dtype == a.dtype, name
        assert got.tobytes() == a.tobytes(), name


def digests(tensors: dict[str, np.ndarray]) -> dict[str, int]:
    return {n: xxhash.xxh3_64_intdigest(np.ascontiguousarray(a).reshape(-1).view(np.uint8)) for n, a in tensors.items()}
