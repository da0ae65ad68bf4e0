"""``tiersync bench registry``: block-hash lookups against the global registry.

Wraps :func:`tiersync.net.registry.bench.bench_registry` (batches of 256 keys,
75% hits, embedded :class:`~tiersync.net.registry.memory.MemoryRegistry`; and
through gRPC on 127.0.0.1 outside ``tiny`` mode) as contract rows. The figure
is **lookups per second**, not GB/s: ``gbps`` and ``baseline_gbps`` carry
lookups/s (``unit`` says so in every row) and ``ratio`` = ours / baseline.
Baseline, in the same run: a plain ``dict.get`` loop over batches of the same
shape. Byte-exact check first: the registry must name the owner of every
published key and no owner for unknown keys, else RoundTripError.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

from tiersync.bench.common import BenchConfig, RoundTripError, median, report

UNIT = "lookups/s"
SHAPES = {"full": (50_000, 400), "quick": (20_000, 200), "tiny": (2_000, 20)}  # keys, batches
BATCH = 256


def _check(corrupt: bool) -> int:
    """Publish keys, look them up, compare owners; returns the keys checked."""
    from tiersync.net.registry.base import StoreInfo
    from tiersync.net.registry.memory import MemoryRegistry

    reg = MemoryRegistry()
    keys = [os.urandom(16) for _ in range(512)]
    for i in range(4):
        reg.register_store(StoreInfo(f"store-{i}", f"127.0.0.1:{7000 + i}", 1000, "g0"))
        reg.publish(f"store-{i}", keys[i::4])
    misses = [os.urandom(16) for _ in range(64)]
    got = reg.lookup(keys + misses)
    owners = _owners(got, keys + misses)
    if corrupt:
        owners[0] = "store-x"
    bad = [k for i, k in enumerate(keys) if owners[i] != f"store-{i % 4}"]
    bad += [k for k, o in zip(misses, owners[len(keys) :]) if o is not None]
    if bad:
        raise RoundTripError("registry lookups disagree with what was published", mismatched=len(bad))
    return len(keys) + len(misses)


def _owners(result: list[tuple[str, ...]], keys: list[bytes]) -> list[str | None]:
    """The first owner id per key (``lookup`` answers one tuple of owners per key, in order)."""
    if len(result) != len(keys):
        raise RoundTripError("registry answered a different number of keys", asked=len(keys), got=len(result))
    return [owners[0] if owners else None for owners in result]


def _dict_baseline(n_keys: int, batches: int, repeats: int) -> list[float]:
    """lookups/s of ``dict.get`` over batches of the same shape (75% hits), ``repeats`` times."""
    table = {os.urandom(16): f"store-{i % 8}" for i in range(n_keys)}
    keys = list(table)
    rng = random.Random(0)
    misses = [os.urandom(16) for _ in range(BATCH // 4)]
    out = []
    for _ in range(repeats):
        total = 0.0
        for _ in range(batches):
            batch = rng.sample(keys, BATCH - len(misses)) + misses
            t0 = time.perf_counter()
            [table.get(k) for k in batch]
            total += time.perf_counter() - t0
        out.append(BATCH * batches / total)
    return out


def _row(name: str, ours: list[dict[str, float]], base: list[float], **extra: Any) -> dict[str, Any]:
    lps = median([o["lookups_per_s"] for o in ours])
    b = median(base)
    return {
        "name": name,
        "gbps": round(lps, 1),
        "baseline": "dict-lookup-loop",
        "baseline_gbps": round(b, 1),
        "ratio": round(lps / b, 4),
        "unit": UNIT,
        "batch_size": BATCH,
        "p50_ms": round(median([o["p50_ms"] for o in ours]), 4),
        "p99_ms": round(median([o["p99_ms"] for o in ours]), 4),
        "roundtrip": "ok",
        **extra,
    }


def run(config: BenchConfig) -> dict[str, Any]:
    """Rows: embedded registry (and gRPC unless tiny), each against the dict loop, interleaved."""
    from tiersync.net.registry.bench import bench_registry

    t0 = time.perf_counter()
    checked = _check(config.inject_corruption)
    n_keys, batches = SHAPES[config.mode]
    reps = 3 if config.mode != "tiny" else 1
    variants = [("registry-memory", False)] + ([("registry-grpc", True)] if config.mode != "tiny" else [])
    variants = [v for v in variants if config.cases is None or config.cases in v[0]]
    results = []
    for name, grpc in variants:
        ours, base = [], []
        for _ in range(reps):  # interleave ours and the baseline
            ours.append(bench_registry(n_keys=n_keys, batches=batches, batch_size=BATCH, via_grpc=grpc))
            base += _dict_baseline(n_keys, batches, 1)
        results.append(
            _row(
                name,
                ours,
                base,
                keys=n_keys,
                batches=batches,
                repeats=reps,
                transport="grpc 127.0.0.1" if grpc else "in-process",
            )
        )
    return report(
        config,
        results,
        units=UNIT,
        roundtrip={"ok": True, "checked_keys": checked},
        elapsed_s=round(time.perf_counter() - t0, 3),
    )
