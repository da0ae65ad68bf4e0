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

import multiprocessing as mp
import os
import tempfile
import time
from typing import Any

import numpy as np

from tiersync.bench import weights_delta
from tiersync.bench import weights_procs as procs
from tiersync.bench.common import (
    BenchConfig,
    RoundTripError,
    median,
    progress,
    report,
    row,
    throughput,
)
from tiersync.bench.weights_raw import memcpy_gbps, raw_seconds
from tiersync.errors import RemoteError, UsageError

CASES = {"full": ((1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4)), "quick": ((1, 4), (2, 4)),
         "tiny": ((1, 2), (2, 2))}  # (trainer shards, samplers)
BUFFERS = {"full": 1, "quick": 2, "tiny": 2}
ROUNDS = {"full": 2, "quick": 1, "tiny": 1}  # interleaved rounds of (shm, tcp, gloo), order rotated
ITERATIONS = {"full": 5, "quick": 3, "tiny": 2}  # timed versions per contender and round (--iterations)
BASELINE = "torch.distributed.broadcast (gloo)"
RAW_BASELINE = "raw loopback sockets (sendmsg -> recv_into, one sender thread per sampler)"
TRIM = {"full": True, "quick": False, "tiny": False}  # samplers free their memory between contenders
_MODE = ["quick"]  # the running mode (set by run)


def _layers(mode: str) -> tuple[int, str]:
    """Layer count that fits in memory, and why."""
    full = procs.SHAPES[mode][2]
    if mode != "full":
        return full, "as specified"
    per = _model_bytes(mode, full)
    most = max(c[1] for c in CASES[mode])
    # tiersync: model + segment + samplers x buffers; gloo: model + segment + 1.5 trainer copies + samplers
    need = lambda n: _model_bytes(mode, n) * max(2 + most * BUFFERS[mode], 3.5 + most)  # noqa: E731
    avail = _mem_available()
    n = full
    while n > 1 and need(n) > 0.5 * avail:  # other tenants come and go: keep half free
        n -= 1
    note = "as specified" if n == full else f"{full} layers ({per / 1e9:.2f} GB) do not fit; using {n}"
    return n, note


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            return next(int(x.split()[1]) * 1024 for x in f if x.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return 1 << 40


def _model_bytes(mode: str, layers: int) -> int:
    return sum(int(np.prod(s)) * 2 for s in procs.model_shapes(mode, layers).values())


class _Model:
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


# -- contenders -------------------------------------------------------------------
def _spawn(target: Any, *args: Any) -> tuple[Any, Any]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*args, child), daemon=True)
    proc.start()
    return proc, parent


def _expect(conn: Any, kind: str, proc: Any, timeout: float = 600) -> tuple:
    if not conn.poll(timeout):
        raise RoundTripError(f"a {kind} receiver did not answer", exitcode=proc.exitcode)
    msg = conn.recv()
    if msg[0] != kind:
        raise RoundTripError(f"expected {kind}, got {msg[0]}")
    return msg


def _stop(children: list[tuple[Any, Any]]) -> None:
    for _, conn in children:
        try:
            conn.send(("stop",))
        except OSError:
            pass
    for proc, _ in children:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def _tiersync(model: _Model, pubs: list, pool: list, n: int, who: str, versions: list[int],
              buffers: int) -> list[float]:
    """Seconds per version of contender ``who`` (shm, zc or tcp); the first version is the
    warm-up and the byte-exact check."""
    workers, transport = pool[:n], "tcp" if who == "tcp" else "auto"
    for r, (_, c) in enumerate(workers):
        c.send(("join", [p.address for p in pubs], r, n, transport, buffers, who == "zc"))
    try:
        granted = {tuple(_expect(c, "ready", p)[1]) for p, c in workers}
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
            _expect(c, "left", p, 120)
            if TRIM[_MODE[0]]:
                c.send(("trim",))


def _check(model: _Model, version: int, conns: list, procs_: list) -> None:
    expected = model.digests(version)
    for conn, _ in zip(conns, procs_):
        conn.send(("digest", version))
    for conn, proc in zip(conns, procs_):
        _, got_version, got = _expect(conn, "digest", proc)
        if got_version != version or got != expected:
            bad = [k for k in expected if got.get(k) != expected[k]][:3]
            raise RoundTripError("a sampler's weights differ from the source; refusing to report",
                                 version=got_version, tensors=bad)


class _Gloo:
    """gloo processes for ``cases`` = [(shards, samplers, versions)]: max shards trainers + max
    samplers receivers in one process group; :meth:`run` times case k (digests checked first)."""

    def __init__(self, model: _Model, mode: str, layers: int, seed: int, cases: list) -> None:
        fd, self.store = tempfile.mkstemp(prefix="tiersync-bench-gloo-")
        os.close(fd)
        os.unlink(self.store)
        self.model, self.cases = model, cases
        self.trainers = max(c[0] for c in cases)
        world = self.trainers + max(c[1] for c in cases)
        self.children = [_spawn(procs.gloo_main, r, world, self.trainers, self.store, mode, layers, seed, cases)
                         for r in range(world)]
        for p, c in self.children:
            _expect(c, "ready", p)

    def run(self, k: int) -> list[float]:
        _shards, n, versions = self.cases[k]
        for _, c in self.children:
            c.send(("go", k))
        expected = self.model.digests(versions[0])
        for p, c in self.children[self.trainers: self.trainers + n]:
            _, _v, got = _expect(c, "digest", p)
            if got != expected:
                raise RoundTripError("a gloo receiver's weights differ from the source; refusing to report")
        return _expect(self.children[0][1], "times", self.children[0][0])[1][1:]

    def close(self) -> None:
        _stop(self.children)
        if os.path.exists(self.store):
            os.unlink(self.store)


# -- the run ----------------------------------------------------------------------
def run(config: BenchConfig) -> dict[str, Any]:
    """Every (trainer shards, samplers) case: tiersync shm and tcp vs gloo, plus the raw figure."""
    t_start = time.perf_counter()
    mode = config.mode
    cases, pcts = _select(config)  # before the model and any process: --cases matching nothing is refused
    _MODE[0] = mode
    layers, memory_note = _layers(mode)
    model = _Model(mode, layers, config.seed)
    results, version, phases = [], [0], {"model": time.perf_counter() - t_start}

    # every buffer set is written once before timing (page faults); quick stays < 60 s
    warm = max(config.warmups if config.warmups is not None else 1, BUFFERS[mode])
    iters = config.iterations if config.iterations is not None else ITERATIONS[mode]

    def versions(k: int) -> list[int]:
        out = list(range(version[0] + 1, version[0] + 1 + warm + k))
        version[0] = out[-1]
        return out

    pool = [_spawn(procs.worker_main) for _ in range(max([n for _, n in cases] + [weights_delta.SAMPLERS] * bool(pcts)))]
    try:
        if cases:
            _sweep(config, model, layers, cases, pool, results, versions, warm, iters, phases)
        if pcts:
            results += _timed(phases, "delta", lambda: weights_delta.run_rows(
                config, model, pool, versions, iters, BUFFERS[mode], _expect, pcts))
    except (BrokenPipeError, EOFError, ConnectionError) as exc:  # not stdout: a child process died
        raise RemoteError(f"a bench child process died (out of memory?): {exc!r}") from exc
    finally:
        _stop(pool)
    return report(config, results, roundtrip={"ok": True, "cases": len(cases)}, model=_model_info(model, layers, mode),
                  memory=memory_note, buffers=BUFFERS[mode], iterations=iters * ROUNDS[mode], warmups=warm,
                  targets=_targets(results), memcpy_1thread_gbps=round(memcpy_gbps(model.nbytes), 3),
                  phase_seconds={k: round(v, 2) for k, v in phases.items()},
                  elapsed_s=round(time.perf_counter() - t_start, 3))


def _select(config: BenchConfig) -> tuple[list[tuple[int, int]], list[int]]:
    """The (shards, samplers) cases whose name ("2t-4s") contains ``--cases``, and the delta rows'
    percentages whose name does; UsageError if nothing does."""
    names = {f"{s}t-{n}s": (s, n) for s, n in CASES[config.mode]}
    chosen = [case for name, case in names.items() if config.cases is None or config.cases in name]
    pcts = weights_delta.selected(config)
    if not chosen and not pcts:
        raise UsageError("no case matches", argument="--cases", value=config.cases,
                         cases=sorted(names) + [weights_delta.NAME.format(p) for p in weights_delta.PCTS])
    return chosen, pcts


def _sweep(config: BenchConfig, model: _Model, layers: int, cases: list, pool: list, results: list,
           versions: Any, warm: int, iters: int, phases: dict) -> None:
    """Cases grouped by trainer shards (publishers live per group); gloo processes per case
    in full mode (memory), one group for the whole run otherwise (start-up time)."""
    from tiersync.weights.config import PublisherConfig
    from tiersync.weights.publisher import WeightPublisher
    from tiersync.weights.sharding import Mesh, Sharding

    mode, rounds, raw_times = config.mode, ROUNDS[config.mode], {}
    plan = [(s, n, rnd) for s, n in cases for rnd in range(rounds)]
    gloo_cases = [(s, n, list(range(10 ** 6 * (k + 1), 10 ** 6 * (k + 1) + warm + iters))) for k, (s, n, _) in
                  enumerate(plan)]
    shared = None if mode == "full" else _Gloo(model, mode, layers, config.seed, gloo_cases)
    specs = {n: t.shape for n, t in model.tensors.items()}
    try:
        with progress(len(plan), config.progress, "bench weights") as bar:
            for shards in sorted({s for s, _ in cases}):
                source = Sharding(Mesh((shards,), ("fsdp",)), ("fsdp",))  # trainer shards split dim 0
                pubs = [WeightPublisher(model.shard(shards, r), source, rank=r, global_shapes=specs,
                                        config=PublisherConfig()) for r in range(shards)]
                try:
                    for _, n in [c for c in cases if c[0] == shards]:
                        times: dict[str, list[float]] = {"shm": [], "zc": [], "tcp": [], "gloo": []}
                        for rnd in range(rounds):
                            k = plan.index((shards, n, rnd))
                            _round(model, pubs, pool, n, rnd, times, phases, versions, warm, iters, BUFFERS[mode],
                                   lambda k=k: _gloo_run(shared, model, mode, layers, config.seed, gloo_cases, k))
                            _timed(phases, "raw", lambda n=n, rnd=rnd: raw_times.setdefault(n, []).extend(
                                raw_seconds(model, pool, n, iters, _expect, TRIM[mode])) if n not in raw_times or rnd else None)
                            bar.update(1)
                        results += _rows(model.nbytes, shards, n, times, raw_times[n], BUFFERS[mode])
                finally:
                    for p in pubs:
                        p.close()
    finally:
        if shared is not None:
            shared.close()


def _round(model, pubs, pool, n, rnd, times, phases, versions, warm, iters, buffers, gloo) -> None:
    """One round of the contenders, order rotated by round (zero-copy right after shm, and
    only from one trainer shard: a replicated tensor of two shards spans two segments)."""
    order = ["shm", "tcp", "gloo"][rnd % 3:] + ["shm", "tcp", "gloo"][: rnd % 3]
    if len(pubs) == 1:
        order.insert(order.index("shm") + 1, "zc")
    for who in order:
        if who == "gloo":
            times[who] += _timed(phases, who, gloo)[warm - 1:]
        else:
            times[who] += _timed(phases, who, lambda who=who: _tiersync(model, pubs, pool, n, who, versions(iters),
                                                                buffers))[warm - 1:]


def _timed(phases: dict, name: str, fn: Any) -> Any:
    t0 = time.perf_counter()
    try:
        return fn()
    finally:
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0


def _gloo_run(shared: _Gloo | None, model: _Model, mode: str, layers: int, seed: int, cases: list, k: int):
    if shared is not None:
        return shared.run(k)
    group = _Gloo(model, mode, layers, seed, [cases[k]])
    try:
        return group.run(0)
    finally:
        group.close()


def _secs(prefix: str, t: list[float]) -> dict[str, float]:
    return {f"{prefix}seconds": round(median(t), 4), f"{prefix}seconds_min": round(min(t), 4),
            f"{prefix}seconds_max": round(max(t), 4)}


def _rows(nbytes: int, shards: int, n: int, times: dict[str, list[float]], raw: list[float], buffers: int) -> list:
    """One row per contender against gloo; with one trainer, TCP again against the raw sockets."""
    rawt = throughput(nbytes, raw)
    common = dict(shards=shards, samplers=n, nbytes=nbytes, **_secs("raw_socket_", raw),
                  raw_socket_gbps=round(rawt["gbps"], 4), raw_socket_aggregate_gbps=round(rawt["gbps"] * n, 4),
                  buffers=buffers, roundtrip="ok")
    out = [_row(f"weights-{shards}t-{n}s-{_NAMES[who]}", nbytes, times[who], BASELINE, times["gloo"],
                _TRANSPORTS[who], common) for who in ("shm", "zc", "tcp") if times[who]]
    if shards == 1 and times["tcp"]:
        out.append(_row(f"weights-1t-{n}s-tcp-vs-raw", nbytes, times["tcp"], RAW_BASELINE, raw, _TRANSPORTS["tcp"],
                        common, gloo_gbps=round(throughput(nbytes, times["gloo"])["gbps"], 4)))
    return out


def _row(name: str, nbytes: int, ours_t: list[float], baseline: str, base_t: list[float], transport: str,
         common: dict, **extra: Any) -> dict[str, Any]:
    ours, base, n = throughput(nbytes, ours_t), throughput(nbytes, base_t), common["samplers"]
    return row(name, ours, baseline, base, **common, transport=transport, **_secs("", ours_t),
               **_secs("baseline_", base_t), aggregate_gbps=round(ours["gbps"] * n, 4),
               baseline_aggregate_gbps=round(base["gbps"] * n, 4), samples=len(ours_t), **extra)


_NAMES = {"shm": "shm", "zc": "shm-zerocopy", "tcp": "tcp"}
_TRANSPORTS = {"shm": "auto (shm), copied into sampler buffers", "zc": "auto (shm), zero-copy leases on the segment",
               "tcp": "tcp forced"}


def _model_info(model: _Model, layers: int, mode: str) -> dict[str, Any]:
    params = model.nbytes // 2
    return {"dtype": "bfloat16", "layers": layers, "tensors": len(model.shapes), "parameters": params,
            "nbytes": model.nbytes, "shape": dict(zip(("hidden", "intermediate", "layers", "kv_dim", "vocab"),
                                                      (*procs.SHAPES[mode][:2], layers, *procs.SHAPES[mode][3:])))}


def _targets(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets at 4 samplers from 1 trainer: shm >= 4x gloo (copy and zero-copy rows
    each), tcp forced >= 1.5x."""
    out: dict[str, Any] = {}
    for who, need in (("shm", 4.0), ("shm-zerocopy", 4.0), ("tcp", 1.5)):
        r = next((r for r in results if r["name"] == f"weights-1t-4s-{who}"), None)
        if r is not None:
            out[who] = {"min_ratio": need, "ratio": r["ratio"], "met": r["ratio"] >= need}
    return out
