"""The delta rows of ``tiersync bench weights``: ``weights-1t-4s-delta-{1,10,100}pct``.

One trainer publishes the bench model to 4 sampler processes over TCP (forced: what crosses
hosts) with ``segment_bytes`` = 1 MiB chunks (the delta granularity). Each timed version
first changes ``pct`` % of the chunks (one byte each, picked by a seeded RNG, outside the
timing), then is published. Contender: samplers with ``ReceiverConfig.delta`` (they fetch
only chunks whose checksum differs from what they hold, copy the rest from their other
buffer set, verify every local chunk). Baseline, same run, same publisher, same changed
bytes: samplers with ``delta=False`` (every byte of every version, as the other rows).
The two alternate by round (order rotated). ``gbps`` is model bytes / seconds for both, so
``ratio`` = full seconds / delta seconds (> 1: delta is faster), the suite's convention.

Checks before any number: after the warm-up version (itself a delta for the contender) and
after the last timed one, every sampler's xxh3 of every tensor equals the source's
(RoundTripError otherwise); and every version's bytes moved (the samplers' reports in the
:class:`~tiersync.weights.publisher.PublishResult`) must be exactly the changed chunks
(delta) or the whole model (full), per sampler.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from tiersync.bench import weights_procs as procs
from tiersync.bench.common import BenchConfig, RoundTripError, median, row, throughput

PCTS = (1, 10, 100)
SAMPLERS = 4
CHUNK = 1 << 20
ROUNDS = 2  # (delta, full) then (full, delta)
NAME = "weights-1t-4s-delta-{}pct"
BASELINE = "full sync of the same versions (ReceiverConfig.delta=False), same run"


def selected(config: BenchConfig) -> list[int]:
    """The percentages whose row name contains ``--cases`` (all without it, except in tiny mode:
    the tests' mode runs them only when asked for)."""
    if config.cases is None:
        return [] if config.mode == "tiny" else list(PCTS)
    return [p for p in PCTS if config.cases in NAME.format(p)]


def _chunks(model: Any, source: Any, dest: Any) -> list[tuple[str, tuple[slice, ...], int]]:
    """Every chunk the plan moves to sampler 0: (tensor, its slices, its bytes)."""
    from tiersync.weights.planner import plan_transfer
    from tiersync.weights.transfer_plan import PlanOptions

    specs = {n: (t.shape, "bfloat16") for n, t in model.tensors.items()}
    plan = plan_transfer(source, dest, specs, PlanOptions(64, CHUNK))
    return [
        (t.tensor, tuple(slice(a, b) for a, b in zip(t.global_box.start, t.global_box.stop)), t.nbytes)
        for t in plan.for_destination(0)
    ]


def _change(model: Any, chunks: list, pct: int, rng: np.random.Generator) -> int:
    """Flip one byte in ``pct`` % of the chunks (at least one); returns their total bytes."""
    k = max(1, math.ceil(len(chunks) * pct / 100))
    moved = 0
    for i in rng.choice(len(chunks), k, replace=False):
        name, box, nbytes = chunks[i]
        region = model.raw[name][box]
        region.reshape(-1)[rng.integers(region.size)] ^= np.uint16(1 + rng.integers(0xFFFF))
        moved += nbytes
    return moved


def _check(model: Any, version: int, workers: list, expect: Callable, corrupt: bool = False) -> None:
    """Every sampler's xxh3 per tensor against the source's; ``corrupt`` (``--inject-corruption``,
    tests only) flips one source byte first, which this check must then refuse."""
    if corrupt:
        first = next(iter(model.raw.values())).reshape(-1)
        first[0] ^= np.uint16(1)
    want = {n: procs.digest(a) for n, a in model.raw.items()}
    for _, c in workers:
        c.send(("digest", version))
    answers = [expect(c, "digest", p) for p, c in workers]  # every answer read: the pipes stay in step
    for _, got_version, got in answers:
        if got_version != version or got != want:
            raise RoundTripError(
                "a sampler's weights differ from the source after a delta sync; refusing to report",
                version=got_version,
                tensors=[k for k in want if got.get(k) != want[k]][:3],
            )


def _contender(model, pub, pool, chunks, pct, delta, versions, iters, buffers, config, expect, moved) -> list[float]:
    """Seconds per timed version for one contender (``delta`` or full samplers); appends the
    bytes each sampler moved per timed version to ``moved``."""
    workers = pool[:SAMPLERS]
    for r, (_, c) in enumerate(workers):
        c.send(("join", [pub.address], r, SAMPLERS, "tcp", buffers, False, delta))
    try:
        for p, c in workers:
            expect(c, "ready", p)
        pub.wait_for_samplers(SAMPLERS, 60)
        rng = np.random.default_rng([config.seed, pct, int(delta)])
        vs = versions(2 + iters)[: 2 + iters]
        _publish(pub, vs[0], model.nbytes)  # nothing held yet: a full sync either way
        times = []
        for i, v in enumerate(vs[1:]):
            changed = _change(model, chunks, pct, rng)
            t0 = time.perf_counter()
            _publish(pub, v, changed if delta else model.nbytes)
            times.append(time.perf_counter() - t0)
            moved.append(changed if delta else model.nbytes)
            if i == 0 or i == iters:
                _check(model, v, workers, expect, config.inject_corruption)
        return times[1:]
    finally:
        for _, c in workers:
            c.send(("leave",))
        for p, c in workers:
            expect(c, "left", p, 120)


def _publish(pub: Any, version: int, per_sampler: int) -> None:
    res = pub.publish(version).result(600)
    if not res.ok:
        raise RoundTripError("a sampler failed", failed=str(res.failed))
    if any(o.moved != per_sampler for o in res.outcomes):
        raise RoundTripError(
            "a sampler moved other bytes than the changed chunks",
            version=version,
            want=per_sampler,
            moved=[o.moved for o in res.outcomes],
        )


def run_rows(
    config: BenchConfig,
    model: Any,
    pool: list,
    versions: Callable,
    iters: int,
    buffers: int,
    expect: Callable,
    pcts: list[int],
) -> list[dict[str, Any]]:
    """The selected delta rows (``pool``: at least 4 sampler processes)."""
    from tiersync.weights.config import PublisherConfig
    from tiersync.weights.publisher import WeightPublisher
    from tiersync.weights.sharding import Mesh, Sharding

    source = Sharding(Mesh((1,), ("fsdp",)), ("fsdp",))
    dest = Sharding.replicated(Mesh((SAMPLERS,), ("dp",)))
    chunks = _chunks(model, source, dest)
    pub = WeightPublisher(model.shard(1, 0), source, config=PublisherConfig(shm=False, segment_bytes=CHUNK))
    out = []
    try:
        for pct in pcts:
            times: dict[bool, list[float]] = {True: [], False: []}
            moved: dict[bool, list[int]] = {True: [], False: []}
            for rnd in range(ROUNDS):
                for delta in (True, False) if rnd % 2 == 0 else (False, True):
                    times[delta] += _contender(
                        model, pub, pool, chunks, pct, delta, versions, iters, buffers, config, expect, moved[delta]
                    )
            out.append(_row(pct, model.nbytes, len(chunks), times, moved, buffers))
    finally:
        pub.close()
    return out


def _row(pct: int, nbytes: int, chunks: int, times: dict, moved: dict, buffers: int) -> dict:
    """``gbps``: model bytes / seconds (what each sampler ends up holding), for both contenders;
    ``moved_bytes``: median bytes one sampler fetched per version (checked exact)."""
    delta_t, full_t = times[True], times[False]
    ours, base = throughput(nbytes, delta_t), throughput(nbytes, full_t)
    return row(
        NAME.format(pct),
        ours,
        BASELINE,
        base,
        shards=1,
        samplers=SAMPLERS,
        nbytes=nbytes,
        transport="tcp forced",
        buffers=buffers,
        chunk_bytes=CHUNK,
        chunks=chunks,
        changed_chunks=max(1, math.ceil(chunks * pct / 100)),
        moved_bytes=int(median(moved[True])),
        baseline_moved_bytes=int(median(moved[False])),
        moved_fraction=round(median(moved[True]) / nbytes, 5),
        seconds=round(median(delta_t), 4),
        baseline_seconds=round(median(full_t), 4),
        samples=len(delta_t),
        roundtrip="ok",
    )
