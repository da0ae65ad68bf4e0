"""The model ``tiersync bench weights`` publishes: a transformer's tensor shapes in bf16
(:mod:`tiersync.bench.weights_procs` has the shapes and the per-version stamping), its bytes,
and how much memory this machine has for it."""

from __future__ import annotations

from typing import Any

import numpy as np

from tiersync.bench import weights_procs as procs

__all__ = ["BenchModel", "mem_available", "model_bytes"]


def mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            return next(int(x.split()[1]) * 1024 for x in f if x.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return 1 << 40


def model_bytes(mode: str, layers: int) -> int:
    return sum(int(np.prod(s)) * 2 for s in procs.model_shapes(mode, layers).values())


class BenchModel:
    """The global bf16 tensors (numpy, ml_dtypes bfloat16 when available), shard views."""

    def __init__(self, mode: str, layers: int, seed: int) -> None:
        self.shapes = procs.model_shapes(mode, layers)
        self.raw = {n: procs.make_tensor(seed, i, s) for i, (n, s) in enumerate(self.shapes.items())}
        self.nbytes = sum(a.nbytes for a in self.raw.values())
        try:
            import ml_dtypes

            self.tensors = {n: a.view(ml_dtypes.bfloat16) for n, a in self.raw.items()}
        except ImportError:  # pragma: no cover - torch carries bf16 then
            import torch

            self.tensors = {n: torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) for n, a in self.raw.items()}

    def stamp(self, version: int) -> None:
        for a in self.raw.values():
            procs.stamp(a, version)

    def digests(self, version: int) -> dict[str, int]:
        self.stamp(version)
        return {n: procs.digest(a) for n, a in self.raw.items()}

    def shard(self, shards: int, s: int) -> dict[str, Any]:
        return {n: t[slice(*procs.shard_rows(t.shape[0], shards, s))] for n, t in self.tensors.items()}

    def info(self, layers: int, mode: str) -> dict[str, Any]:
        """What the report says about the model."""
        params = self.nbytes // 2
        return {
            "dtype": "bfloat16",
            "layers": layers,
            "tensors": len(self.shapes),
            "parameters": params,
            "nbytes": self.nbytes,
            "shape": dict(
                zip(
                    ("hidden", "intermediate", "layers", "kv_dim", "vocab"),
                    (*procs.SHAPES[mode][:2], layers, *procs.SHAPES[mode][3:]),
                )
            ),
        }
