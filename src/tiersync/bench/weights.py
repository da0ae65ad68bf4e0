"""``tiersync bench weights``: trainer -> sampler weight sync on one machine.

A model shaped like a 1B-parameter transformer in bf16 (Llama-3.2-1B layout, 32k tied
vocabulary: 1.04 B parameters, 2.08 GB; ``--quick``: 6 layers of width 1024, 248 MB) is
published from 1 trainer and from 2 trainer shards (split along dim 0, publishers in this
process) to 1, 2 and 4 sampler PROCESSES, each holding the whole model (replicated), by:

- ``shm``: tiersync, transport AUTO (same host: one write into /dev/shm, every sampler
  copies its slices out);
- ``shm-zerocopy`` (1 trainer only): transport AUTO with ``ReceiverConfig.zero_copy``: each
  sampler's lease reads the version's segment in place (no copy; the trainer writes the next
  version to another segment while one is held) -- a separate row, the copy row stays;
- ``tcp``: tiersync with TCP forced (GETs over loopback, 4 streams per sampler, xxh3 on
  every payload);
- the baseline, ``torch.distributed.broadcast`` over gloo (real processes, FileStore): each
  trainer shard broadcasts its rows of every tensor to the samplers;
- the loopback raw-socket figure: this process ``sendmsg``s the model's bytes to each
  receiver process (one thread each), which ``recv_into``s them (a ceiling for TCP). Each
  1-trainer case also gets a ``weights-1t-<n>s-tcp-vs-raw`` row: the same ``tcp`` times with
  this raw figure as the baseline (ratio = tiersync TCP GB/s / raw GB/s: what the wire stack,
  token, checksums and GET protocol cost over bare sockets).
- the delta rows ``weights-1t-4s-delta-{1,10,100}pct`` (:mod:`tiersync.bench.weights_delta`):
  versions changing that share of the chunks, delta samplers vs full-sync samplers. The rows
  above run with ``ReceiverConfig.delta`` off: they move every byte of every version.

Seconds are publish to "every sampler switched" (tiersync: D2H into the version buffer
included) and first to last broadcast (gloo). ``gbps`` is per receiver (model bytes /
seconds), ``aggregate_gbps`` multiplies by the samplers. Before any number, every receiver's
xxh3 of every tensor is compared with the source (RoundTripError otherwise). Memory: full
mode uses single-buffered samplers (``buffers=1``) and shrinks the layer count when
MemAvailable cannot hold the trainer copy + segment + 4 sampler copies; the report says.
"""

from __future__ import annotations

import time
from typing import Any

from tiersync.bench import weights_delta
from tiersync.bench import weights_procs as procs
from tiersync.bench.common import (
    BenchConfig,
    RoundTripError,
    progress,
    report,
)
from tiersync.bench.weights_children import Gloo, expect, gloo_run, spawn, stop
from tiersync.bench.weights_model import BenchModel, mem_available, model_bytes
from tiersync.bench.weights_raw import memcpy_gbps, raw_seconds
from tiersync.bench.weights_rows import case_rows, targets
from tiersync.errors import RemoteError, UsageError

CASES = {
    "full": ((1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4)),
    "quick": ((1, 4), (2, 4)),
    "tiny": ((1, 2), (2, 2)),
}  # (trainer shards, samplers)
BUFFERS = {"full": 1, "quick": 2, "tiny": 2}
ROUNDS = {"full": 2, "quick": 1, "tiny": 1}  # interleaved rounds of (shm, tcp, gloo), order rotated
ITERATIONS = {"full": 5, "quick": 3, "tiny": 2}  # timed versions per contender and round (--iterations)
TRIM = {"full": True, "quick": False, "tiny": False}  # samplers free their memory between contenders
_MODE = ["quick"]  # the running mode (set by run)


def _layers(mode: str) -> tuple[int, str]:
    """Layer count that fits in memory, and why."""
    full = procs.SHAPES[mode][2]
    if mode != "full":
        return full, "as specified"
    per = model_bytes(mode, full)
    most = max(c[1] for c in CASES[mode])
    # tiersync: model + segment + samplers x buffers; gloo: model + segment + 1.5 trainer copies + samplers
    need = lambda n: model_bytes(mode, n) * max(2 + most * BUFFERS[mode], 3.5 + most)  # noqa: E731
    avail = mem_available()
    n = full
    while n > 1 and need(n) > 0.5 * avail:  # other tenants come and go: keep half free
        n -= 1
    note = "as specified" if n == full else f"{full} layers ({per / 1e9:.2f} GB) do not fit; using {n}"
    return n, note


# -- contenders -------------------------------------------------------------------
def _tiersync(
    model: BenchModel, pubs: list, pool: list, n: int, who: str, versions: list[int], buffers: int
) -> list[float]:
    """Seconds per version of contender ``who`` (shm, zc or tcp); the first version is the
    warm-up and the byte-exact check."""
    workers, transport = pool[:n], "tcp" if who == "tcp" else "auto"
    for r, (_, c) in enumerate(workers):
        c.send(("join", [p.address for p in pubs], r, n, transport, buffers, who == "zc"))
    try:
        granted = {tuple(expect(c, "ready", p)[1]) for p, c in workers}
        want = ("shm" if transport == "auto" else "tcp",) * len(pubs)
        if granted != {want}:
            raise RoundTripError("transport not as configured", granted=sorted(granted), want=want)
        for p in pubs:
            p.wait_for_samplers(n, 60)
        times = []
        for i, v in enumerate(versions):
            model.stamp(v)
            t0 = time.perf_counter()
            results = [f.result(600) for f in [p.publish(v) for p in pubs]]
            times.append(time.perf_counter() - t0)
            if not all(r.ok for r in results):
                raise RoundTripError("a sampler failed", failed=[str(r.failed) for r in results])
            if i == 0:
                _check(model, v, [c for _, c in workers], procs_=[p for p, _ in workers])
        return times[1:]
    finally:
        for _, c in workers:
            c.send(("leave",))
        for p, c in workers:
            expect(c, "left", p, 120)
            if TRIM[_MODE[0]]:
                c.send(("trim",))


def _check(model: BenchModel, version: int, conns: list, procs_: list) -> None:
    expected = model.digests(version)
    for conn, _ in zip(conns, procs_):
        conn.send(("digest", version))
    for conn, proc in zip(conns, procs_):
        _, got_version, got = expect(conn, "digest", proc)
        if got_version != version or got != expected:
            bad = [k for k in expected if got.get(k) != expected[k]][:3]
            raise RoundTripError(
                "a sampler's weights differ from the source; refusing to report", version=got_version, tensors=bad
            )


# -- the run ----------------------------------------------------------------------
def run(config: BenchConfig) -> dict[str, Any]:
    """Every (trainer shards, samplers) case: tiersync shm and tcp vs gloo, plus the raw figure."""
    t_start = time.perf_counter()
    mode = config.mode
    cases, pcts = _select(config)  # before the model and any process: --cases matching nothing is refused
    _MODE[0] = mode
    layers, memory_note = _layers(mode)
    model = BenchModel(mode, layers, config.seed)
    results, version, phases = [], [0], {"model": time.perf_counter() - t_start}

    # every buffer set is written once before timing (page faults); quick stays < 60 s
    warm = max(config.warmups if config.warmups is not None else 1, BUFFERS[mode])
    iters = config.iterations if config.iterations is not None else ITERATIONS[mode]

    def versions(k: int) -> list[int]:
        out = list(range(version[0] + 1, version[0] + 1 + warm + k))
        version[0] = out[-1]
        return out

    pool = [spawn(procs.worker_main) for _ in range(max([n for _, n in cases] + [weights_delta.SAMPLERS] * bool(pcts)))]
    try:
        if cases:
            _sweep(config, model, layers, cases, pool, results, versions, warm, iters, phases)
        if pcts:
            results += _timed(
                phases,
                "delta",
                lambda: weights_delta.run_rows(config, model, pool, versions, iters, BUFFERS[mode], expect, pcts),
            )
    except (BrokenPipeError, EOFError, ConnectionError) as exc:  # not stdout: a child process died
        raise RemoteError(f"a bench child process died (out of memory?): {exc!r}") from exc
    finally:
        stop(pool)
    return report(
        config,
        results,
        roundtrip={"ok": True, "cases": len(cases)},
        model=model.info(layers, mode),
        memory=memory_note,
        buffers=BUFFERS[mode],
        iterations=iters * ROUNDS[mode],
        warmups=warm,
        targets=targets(results),
        memcpy_1thread_gbps=round(memcpy_gbps(model.nbytes), 3),
        phase_seconds={k: round(v, 2) for k, v in phases.items()},
        elapsed_s=round(time.perf_counter() - t_start, 3),
    )


def _select(config: BenchConfig) -> tuple[list[tuple[int, int]], list[int]]:
    """The (shards, samplers) cases whose name ("2t-4s") contains ``--cases``, and the delta rows'
    percentages whose name does; UsageError if nothing does."""
    names = {f"{s}t-{n}s": (s, n) for s, n in CASES[config.mode]}
    chosen = [case for name, case in names.items() if config.cases is None or config.cases in name]
    pcts = weights_delta.selected(config)
    if not chosen and not pcts:
        raise UsageError(
            "no case matches",
            argument="--cases",
            value=config.cases,
            cases=sorted(names) + [weights_delta.NAME.format(p) for p in weights_delta.PCTS],
        )
    return chosen, pcts


def _sweep(
    config: BenchConfig,
    model: BenchModel,
    layers: int,
    cases: list,
    pool: list,
    results: list,
    versions: Any,
    warm: int,
    iters: int,
    phases: dict,
) -> None:
    """Cases grouped by trainer shards (publishers live per group); gloo processes per case
    in full mode (memory), one group for the whole run otherwise (start-up time)."""
    from tiersync.weights.config import PublisherConfig
    from tiersync.weights.publisher import WeightPublisher
    from tiersync.weights.sharding import Mesh, Sharding

    mode, rounds, raw_times = config.mode, ROUNDS[config.mode], {}
    plan = [(s, n, rnd) for s, n in cases for rnd in range(rounds)]
    gloo_cases = [
        (s, n, list(range(10**6 * (k + 1), 10**6 * (k + 1) + warm + iters))) for k, (s, n, _) in enumerate(plan)
    ]
    shared = None if mode == "full" else Gloo(model, mode, layers, config.seed, gloo_cases)
    specs = {n: t.shape for n, t in model.tensors.items()}
    try:
        with progress(len(plan), config.progress, "bench weights") as bar:
            for shards in sorted({s for s, _ in cases}):
                source = Sharding(Mesh((shards,), ("fsdp",)), ("fsdp",))  # trainer shards split dim 0
                pubs = [
                    WeightPublisher(
                        model.shard(shards, r), source, rank=r, global_shapes=specs, config=PublisherConfig()
                    )
                    for r in range(shards)
                ]
                try:
                    for _, n in [c for c in cases if c[0] == shards]:
                        times = _case_times(
                            config,
                            model,
                            pubs,
                            pool,
                            n,
                            versions,
                            warm,
                            iters,
                            phases,
                            raw_times,
                            lambda rnd, s=shards, n=n: plan.index((s, n, rnd)),
                            bar,
                            lambda k: gloo_run(shared, model, mode, layers, config.seed, gloo_cases, k),
                        )
                        results += case_rows(model.nbytes, shards, n, times, raw_times[n], BUFFERS[mode])
                finally:
                    for p in pubs:
                        p.close()
    finally:
        if shared is not None:
            shared.close()


def _case_times(
    config: BenchConfig,
    model: BenchModel,
    pubs: list,
    pool: list,
    n: int,
    versions: Any,
    warm: int,
    iters: int,
    phases: dict,
    raw_times: dict,
    index: Any,
    bar: Any,
    gloo: Any,
) -> dict[str, list[float]]:
    """Every round of one (shards, samplers) case: the contenders' times (the raw figure once
    per sampler count, more in later rounds); ``index(rnd)`` is the round's gloo case."""
    mode, times = config.mode, {"shm": [], "zc": [], "tcp": [], "gloo": []}
    for rnd in range(ROUNDS[mode]):
        k = index(rnd)
        _round(model, pubs, pool, n, rnd, times, phases, versions, warm, iters, BUFFERS[mode], lambda k=k: gloo(k))
        if n not in raw_times or rnd:
            _timed(
                phases,
                "raw",
                lambda: raw_times.setdefault(n, []).extend(raw_seconds(model, pool, n, iters, expect, TRIM[mode])),
            )
        bar.update(1)
    return times


def _round(model, pubs, pool, n, rnd, times, phases, versions, warm, iters, buffers, gloo) -> None:
    """One round of the contenders, order rotated by round (zero-copy right after shm, and
    only from one trainer shard: a replicated tensor of two shards spans two segments)."""
    order = ["shm", "tcp", "gloo"][rnd % 3 :] + ["shm", "tcp", "gloo"][: rnd % 3]
    if len(pubs) == 1:
        order.insert(order.index("shm") + 1, "zc")
    for who in order:
        if who == "gloo":
            times[who] += _timed(phases, who, gloo)[warm - 1 :]
        else:
            times[who] += _timed(
                phases, who, lambda who=who: _tiersync(model, pubs, pool, n, who, versions(iters), buffers)
            )[warm - 1 :]


def _timed(phases: dict, name: str, fn: Any) -> Any:
    t0 = time.perf_counter()
    try:
        return fn()
    finally:
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0
