"""``tiersync bench d2h|h2d``: block copies between KV pools and the host arena.

For every case (see :func:`cases`): a byte-exact round trip first (the suite
refuses to report without it), then ``warmups`` + ``iterations`` rounds in
which three contenders run interleaved, in a rotating order, each on freshly
touched data (one byte per moved block changes before each copy):

- ``engine`` — :class:`~tiersync.transfer.TransferEngine` (submit + wait);
- ``naive-loop`` — per layer, per block ``host[j] = dev[i]`` numpy slice assignment;
- ``memcpy`` — the baseline: ``np.copyto`` of the same byte count between two
  contiguous, pre-faulted uint8 buffers.

Rows: the engine (``ratio`` = engine / memcpy, plus ``vs_naive``) and the naive
loop (``ratio`` = naive / memcpy), with the reference's gate floor per row.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from tiersync.bench.common import BenchConfig, Stopwatch, progress, report, row, throughput
from tiersync.bench.kvfixture import Case, Fixture, build, round_trip

DIRECTIONS = ("d2h", "h2d")
_BF = (8, 2, 128)  # kv heads, (k, v), head dim: bf16 => 4 KiB per token


def _kv(tokens: int, dtype: str = "bf16") -> tuple[int, ...]:
    """Block shape of ``tokens`` tokens (fp32 halves, int8 doubles the tokens to keep bytes)."""
    scale = {"bf16": 1.0, "fp16": 1.0, "fp32": 0.5, "int8": 2.0}[dtype]
    return (max(int(tokens * scale), 1), *_BF)


def cases(mode: str) -> list[Case]:
    """The cases of ``mode`` ("full", "quick" or "tiny"); full pools stay under ~1.3 GiB each case."""
    q, t = mode == "quick", mode == "tiny"

    def size(full: tuple[int, int], quick: tuple[int, int]) -> tuple[int, int]:
        return (2, 4) if t else quick if q else full

    out = [
        Case("ref-512k-bf16", _kv(128), "bf16", *size((64, 16), (16, 4)), "reference"),
        Case("ref-512k-bf16-kv-strided", _kv(128), "bf16", *size((16, 16), (4, 4)), "reference", split_kv=True),
        Case("acc-64k-bf16", _kv(16), "bf16", *size((64, 256), (64, 32)), "acceptance"),
        Case("acc-16k-bf16", _kv(4), "bf16", *size((64, 256), (64, 128)), "acceptance"),
        Case(
            "acc-64k-bf16-scattered-both", _kv(16), "bf16", *size((64, 256), (64, 32)), "acceptance", scatter_host=True
        ),
        Case("large-4m-bf16", _kv(1024), "bf16", *size((8, 16), (4, 4)), "large"),
    ]
    for dt in ("fp16", "bf16", "fp32", "int8"):
        out.append(Case(f"dtype-{dt}-64k", _kv(16, dt), dt, *size((16, 128), (16, 16)), "dtype"))
    total = 4 << 20 if t else (16 << 20 if q else 256 << 20)  # bytes per transfer, whole sweep
    layers = 2 if t else 8
    for tokens in (1, 4, 16, 64, 256, 1024):
        nb = tokens * 4096
        out.append(
            Case(
                f"blocksize-{nb >> 10}k-bf16", _kv(tokens), "bf16", layers, max(total // (layers * nb), 2), "block-size"
            )
        )
    return out


# -- the three contenders ----------------------------------------------------
def _engine_op(fx: Fixture, direction: str) -> Callable[[], None]:
    runs, post = (fx.d2h_runs, fx.engine.d2h) if direction == "d2h" else (fx.h2d_runs, fx.engine.h2d)
    return lambda: post(runs).result()


def _naive_op(fx: Fixture, direction: str) -> Callable[[], None]:
    pairs = [(int(d), int(h)) for d, h in zip(fx.dev, fx.host)]
    groups = list(zip(fx.aliases, fx.host_views))

    def d2h() -> None:
        for dev, host in groups:
            for i, j in pairs:
                host[j] = dev[i]

    def h2d() -> None:
        for dev, host in groups:
            for i, j in pairs:
                dev[i] = host[j]

    return d2h if direction == "d2h" else h2d


def _touch_op(fx: Fixture, direction: str) -> Callable[[], None]:
    """Change one byte per moved block on the source side (not timed)."""
    if direction == "h2d":
        rows = fx.host.astype(np.int64)
        return lambda: np.add.at(fx.arena.memory, (rows, 0), 1)
    idx = [(fx.dev,) + (0,) * (a.ndim - 1) for a in fx.aliases]
    pairs = list(zip(fx.aliases, idx))

    def touch() -> None:
        for a, ix in pairs:
            a[ix] += 1

    return touch


def _memcpy_op(nbytes: int) -> tuple[Callable[[], None], Callable[[], None]]:
    src = np.empty(nbytes, dtype=np.uint8)
    dst = np.empty(nbytes, dtype=np.uint8)
    src.fill(1)
    np.copyto(dst, src)  # fault every page of both

    def touch() -> None:
        src[:: 1 << 16] += 1

    return (lambda: np.copyto(dst, src)), touch


# -- timing ------------------------------------------------------------------
def _time_case(fx: Fixture, direction: str, config: BenchConfig, bar: Any) -> dict[str, list[float]]:
    """Interleave the contenders for warm-ups + iterations; return timed seconds per contender."""
    mem_op, mem_touch = _memcpy_op(fx.case.nbytes)
    touch = _touch_op(fx, direction)
    contenders = [
        ("engine", _engine_op(fx, direction), touch),
        ("naive-loop", _naive_op(fx, direction), touch),
        ("memcpy", mem_op, mem_touch),
    ]
    samples: dict[str, list[float]] = {name: [] for name, _, _ in contenders}
    for it in range(config.n_warmups + config.n_iterations):
        k = it % len(contenders)
        for name, op, prep in contenders[k:] + contenders[:k]:
            prep()
            with Stopwatch() as sw:
                op()
            if it >= config.n_warmups:
                samples[name].append(sw.seconds)
        bar.update(1)
    return samples


def _rows(case: Case, fx: Fixture, direction: str, samples: dict[str, list[float]]) -> list[dict[str, Any]]:
    ours, naive, base = (throughput(case.nbytes, samples[k]) for k in ("engine", "naive-loop", "memcpy"))
    info = {
        "direction": direction,
        "group": case.group,
        "dtype": case.dtype,
        "backend": fx.backend,
        "layers": case.layers,
        "pools": len(fx.layout.pools),
        "blocks_moved": case.moved,
        "pool_blocks": case.pool_blocks,
        "block_nbytes": case.block_nbytes,
        "nbytes": case.nbytes,
        "scatter": "both" if case.scatter_host else "device",
        "strided": case.split_kv,
        "roundtrip": "ok",
    }
    return [
        row(case.name, ours, "memcpy", base, method="engine", vs_naive=round(ours["gbps"] / naive["gbps"], 4), **info),
        row(f"{case.name}/naive-loop", naive, "memcpy", base, method="naive-loop", **info),
    ]


def run(config: BenchConfig) -> dict[str, Any]:
    """Run the ``config.suite`` direction over every case; raises RoundTripError rather than report."""
    from tiersync.telemetry import Metrics

    direction = config.suite
    if direction not in DIRECTIONS:
        raise ValueError(f"copy suite runs d2h or h2d, not {direction!r}")
    metrics = Metrics()
    t0 = time.perf_counter()
    all_cases = [c for c in cases(config.mode) if config.cases is None or config.cases in c.name]
    if not all_cases:
        from tiersync.errors import UsageError

        raise UsageError("no case matches", argument="--cases", value=config.cases)
    results: list[dict[str, Any]] = []
    checked = 0
    steps = len(all_cases) * (config.n_warmups + config.n_iterations)
    with progress(steps, config.progress, f"bench {direction}") as bar:
        for i, case in enumerate(all_cases):
            bar.set_postfix_str(case.name)
            fx = build(case, workers=config.workers, seed=config.seed + i, metrics=metrics, use_torch=not config.tiny)
            try:
                checked += round_trip(fx, corrupt=config.inject_corruption)["checked_bytes"]
                results.extend(_rows(case, fx, direction, _time_case(fx, direction, config, bar)))
            finally:
                fx.close()
    return report(
        config,
        results,
        roundtrip={"ok": True, "cases": len(all_cases), "checked_bytes": checked},
        telemetry=_telemetry(metrics),
        elapsed_s=round(time.perf_counter() - t0, 3),
    )


def _telemetry(metrics: Any) -> dict[str, Any]:
    """What the engine reported to Prometheus during the run (item 6 wiring)."""
    get = metrics.registry.get_sample_value
    out: dict[str, Any] = {}
    for d in DIRECTIONS:
        out[d] = {
            "transferred_bytes": get("tiersync_transferred_bytes_total", {"direction": d}) or 0.0,
            "transfers": get("tiersync_transfer_seconds_count", {"direction": d}) or 0.0,
            "failures": get("tiersync_transfer_failures_total", {"direction": d}) or 0.0,
        }
    return out
