"""KV pools for the copy benches: the cases, their memory, and the byte-exact round trip.

A :class:`Case` is a per-layer pool ``(pool_blocks, *block_shape)`` of ``dtype``
(``split_kv``: the K and V halves of axis -2 as two strided pools per layer),
of which ``moved`` random, non-contiguous device blocks per transfer move to
host blocks ``0..moved-1`` (``scatter_host``: random host blocks of an arena
twice as large). A :class:`Fixture` binds a case to real memory: the pools,
numpy unsigned-int *aliases* of them (bit-exact comparisons, no NaN trouble),
an arena, an engine, and typed views of each pool's segment of the host image.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tiersync.bench.common import RoundTripError

DTYPES = {"fp16": (np.float16, 2), "bf16": (None, 2), "fp32": (np.float32, 4), "int8": (np.int8, 1)}
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True, slots=True)
class Case:
    """One shape to time; ``group`` names the sweep it belongs to."""

    name: str
    block_shape: tuple[int, ...]
    dtype: str
    layers: int
    moved: int
    group: str
    scatter_host: bool = False
    split_kv: bool = False

    @property
    def pool_blocks(self) -> int:
        """Device blocks per pool: room around the moved ones so their ids are scattered."""
        return self.moved + max(self.moved // 4, 4)

    @property
    def block_nbytes(self) -> int:
        """Live bytes of one device block of one layer (K and V together)."""
        return int(np.prod(self.block_shape)) * DTYPES[self.dtype][1]

    @property
    def nbytes(self) -> int:
        """Bytes one transfer moves."""
        return self.layers * self.moved * self.block_nbytes


@dataclass(eq=False)
class Fixture:
    """A case bound to memory. ``dev``/``host``: device and host block ids, moved pairwise."""

    case: Case
    pools: list[Any]
    aliases: list[np.ndarray]
    bases: list[np.ndarray]
    layout: Any
    arena: Any
    engine: Any
    host_views: list[np.ndarray]
    dev: np.ndarray
    host: np.ndarray
    backend: str
    d2h_runs: list[tuple[int, int, int]] = field(init=False)
    h2d_runs: list[tuple[int, int, int]] = field(init=False)

    def __post_init__(self) -> None:
        self.d2h_runs = [(int(d), int(h), 1) for d, h in zip(self.dev, self.host)]
        self.h2d_runs = [(h, d, 1) for d, h, _ in self.d2h_runs]

    def close(self) -> None:
        self.engine.close()
        self.host_views.clear()
        self.arena.close()
        self.pools.clear()
        self.aliases.clear()
        self.bases.clear()


def build(case: Case, *, workers: int, seed: int, metrics: Any = None, use_torch: bool = True) -> Fixture:
    """Allocate and fill ``case``'s pools, an arena and an engine (pages faulted).

    bf16 pools are torch tensors when ``use_torch`` and torch imports, else uint16 arrays.
    """
    from tiersync.layout import kv_layout
    from tiersync.tiers.host import HostArena
    from tiersync.transfer import TransferConfig, TransferEngine

    rng = np.random.default_rng(seed)
    bases, backend = _allocate(case, use_torch)
    for layer, b in enumerate(bases):
        _fill(b, seed * 1000003 + layer)
    if case.split_kv:
        pools = [(b[..., 0, :], b[..., 1, :]) for b in bases]
        tags = ("k", "v")
    else:
        pools, tags = list(bases), None
    layout = kv_layout(pools, tags=tags)
    flat = [p for group in pools for p in (group if isinstance(group, tuple) else (group,))]
    aliases = [_alias(p) for p in flat]
    n_host = case.moved * (2 if case.scatter_host else 1)
    arena = HostArena.for_layout(layout, n_host)
    arena.allocate(n_host)  # every host block stays LOCKED for the bench's lifetime
    arena.memory[...] = 0  # fault the pages now, not in the first timed copy
    dev = rng.choice(case.pool_blocks, case.moved, replace=False)
    host = rng.choice(n_host, case.moved, replace=False) if case.scatter_host else np.arange(case.moved)
    engine = TransferEngine(layout, arena, TransferConfig(workers=workers), metrics=metrics)
    views = [_host_view(arena, off, a) for off, a in zip(layout.host_offsets, aliases)]
    return Fixture(
        case, list(flat), aliases, [_alias(b) for b in bases], layout, arena, engine, views, dev, host, backend
    )


def _allocate(case: Case, use_torch: bool) -> tuple[list[Any], str]:
    shape = (case.pool_blocks, *case.block_shape)
    np_type = DTYPES[case.dtype][0]
    if np_type is not None:
        return [np.empty(shape, dtype=np_type) for _ in range(case.layers)], "numpy"
    try:
        if not use_torch:
            raise ImportError("torch not wanted")
        import torch
    except ImportError:  # bf16 as its bit pattern
        return [np.empty(shape, dtype=np.uint16) for _ in range(case.layers)], "numpy-uint16-view"
    return [torch.empty(shape, dtype=torch.bfloat16) for _ in range(case.layers)], "torch"


def _alias(t: Any) -> np.ndarray:
    """The same memory as an unsigned-int numpy array (same shape and strides)."""
    if type(t).__module__.split(".")[0] == "torch":
        import torch

        t = t.view(torch.int16).numpy()
    return t.view(np.dtype(f"u{t.dtype.itemsize}"))


def _fill(base: Any, seed: int) -> None:
    """Distinct bytes everywhere (a multiplicative hash of the word index), one layer at a time."""
    words = _alias(base).reshape(-1).view(np.uint64)
    idx = np.arange(words.size, dtype=np.uint64)
    idx += np.uint64(seed) << np.uint64(40)
    np.multiply(idx, _GOLDEN, out=words)


def _host_view(arena: Any, offset: int, alias: np.ndarray) -> np.ndarray:
    """Pool segment of every host block, typed and shaped like one block of ``alias``."""
    nb = int(np.prod(alias.shape[1:])) * alias.itemsize
    seg = arena.memory[:, offset : offset + nb].view(alias.dtype).reshape(arena.num_blocks, *alias.shape[1:])
    if seg.__array_interface__["data"][0] != arena.address + offset:
        raise AssertionError("host view must alias the arena, not copy it")
    return seg


def round_trip(fx: Fixture, *, corrupt: bool = False) -> dict[str, Any]:
    """d2h the moved blocks, check the host image, h2d them into each other's places, check.

    Device block ``dev[k]`` goes to host block ``host[k]``, then comes back into
    ``dev[(k+1) % n]`` (another block) after every moved block was scrambled;
    untouched device blocks must stay untouched. Raises :class:`RoundTripError`
    naming the first mismatch. ``corrupt`` flips one host byte in between
    (tests only: proves the check bites).
    """
    untouched = _untouched_digest(fx)
    fx.engine.d2h(fx.d2h_runs).result()
    if corrupt:
        fx.arena.memory[int(fx.host[-1]), 0] ^= 0xFF
    for p, (alias, view) in enumerate(zip(fx.aliases, fx.host_views)):
        _compare(fx, p, "d2h", view[fx.host], alias[fx.dev], fx.dev, fx.host)
    for alias in fx.aliases:
        alias[fx.dev] = alias.dtype.type(0x5A)
    shifted = np.roll(fx.dev, -1)
    fx.engine.h2d([(int(h), int(d), 1) for h, d in zip(fx.host, shifted)]).result()
    for p, (alias, view) in enumerate(zip(fx.aliases, fx.host_views)):
        _compare(fx, p, "h2d", alias[shifted], view[fx.host], fx.host, shifted)
    if _untouched_digest(fx) != untouched:
        raise RoundTripError("round trip wrote outside the moved device blocks; refusing to report", case=fx.case.name)
    return {"checked_bytes": 2 * fx.case.nbytes, "ok": True}


def _compare(
    fx: Fixture, p: int, step: str, got: np.ndarray, want: np.ndarray, src: np.ndarray, dst: np.ndarray
) -> None:
    diff = (got != want).reshape(len(src), -1).any(axis=1)
    if diff.any():
        k = int(np.argmax(diff))
        pool = fx.layout.pools[p]
        nbad = int((got[k] != want[k]).sum())
        names = ("device", "host") if step == "d2h" else ("host", "device")
        raise RoundTripError(
            f"round trip not byte-exact at {step}: {nbad} element(s) differ in the copy of "
            f"{names[0]} block {int(src[k])} to {names[1]} block {int(dst[k])}; refusing to report",
            case=fx.case.name,
            pool=p,
            layer=pool.layer,
            tag=pool.spec.tag,
        )


def _untouched_digest(fx: Fixture) -> bytes:
    import xxhash

    keep = np.setdiff1d(np.arange(fx.case.pool_blocks), fx.dev)
    h = xxhash.xxh3_64()
    for b in fx.bases:
        h.update(np.ascontiguousarray(b[keep]).data)
    return h.digest()
