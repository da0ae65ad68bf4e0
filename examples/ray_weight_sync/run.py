"""RL weight sync on Ray: a trainer actor publishes each step's weights, sampler actors load them.

    .venv/bin/python examples/ray_weight_sync/run.py [--samplers 4] [--tp 2] [--steps 3]

Starts a local Ray cluster (or joins ``--address``), a named trainer actor holding a torch
model and N sampler actors (a dp x tp mesh: ``--tp 2`` gives each sampler half the rows of
every tensor, resharded from the trainer's full copy). Per step: ``train_step`` (one SGD
step), ``publish(v)`` (the publisher's result: one outcome per sampler), then every sampler
reports the sha256 of each tensor it serves, checked against the trainer's slices.
Exits 1 when a sampler failed or holds other bytes.
"""

from __future__ import annotations

import argparse
import secrets
import sys
import time

import ray
from ray_workers import TRAINER_NAME, SamplerWorker, TrainerWorker


def start(args: argparse.Namespace, token: str) -> tuple:
    """The trainer (named: samplers look it up) and the samplers, all registered."""
    # num_cpus=0: these actors mostly wait; a real trainer asks for its GPUs (num_gpus=...)
    trainer = (
        ray.remote(TrainerWorker)
        .options(name=TRAINER_NAME, num_cpus=0)
        .remote(token, hidden=args.hidden, layers=args.layers)
    )
    dp = args.samplers // args.tp
    samplers = [
        ray.remote(SamplerWorker).options(num_cpus=0).remote(rank, dp, args.tp, token) for rank in range(args.samplers)
    ]
    ray.get([s.ready.remote() for s in samplers])  # each has registered with the trainer
    ray.get(trainer.wait_for_samplers.remote(len(samplers)))
    return trainer, samplers


def step(trainer, samplers: list, version: int, dp: int, tp: int) -> bool:
    """train -> publish -> samplers confirm; True when every sampler holds the trainer's bytes."""
    loss = ray.get(trainer.train_step.remote())
    result = ray.get(trainer.publish.remote(version))
    held = ray.get([s.wait_version.remote(version) for s in samplers])
    want = ray.get(trainer.expected.remote(dp, tp))
    print(
        f"version {version}: loss {loss:.4f}, {result.nbytes / 2**20:.1f} MiB published in "
        f"{result.seconds * 1e3:.1f} ms, ok={result.ok}"
    )
    for o in result.outcomes:
        h = held[o.rank]
        same = h["version"] == version and h["tensors"] == want[o.rank]
        print(
            f"  {o.sampler}: {o.status.value} via {o.transport.value}, holds v{h['version']}, "
            f"bytes {'match' if same else 'DIFFER'}" + (f" ({o.error})" if o.error else "")
        )
    return (
        result.ok
        and len(result.outcomes) == len(samplers)
        and all(h["version"] == version and h["tensors"] == want[r] for r, h in enumerate(held))
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samplers", type=int, default=4)
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel degree of the samplers")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--address", default=None, help="an existing Ray cluster (default: start a local one)")
    args = ap.parse_args()
    if args.samplers < 1 or args.tp < 1 or args.samplers % args.tp:
        ap.error("--samplers must be a positive multiple of --tp")
    ray.init(address=args.address, include_dashboard=False)
    token = secrets.token_hex(16)  # every sampler proves it on every connection
    trainer, samplers = start(args, token)
    ok = True
    try:
        t0 = time.perf_counter()
        for version in range(1, args.steps + 1):
            ok = step(trainer, samplers, version, args.samplers // args.tp, args.tp) and ok
        print(f"{args.steps} steps in {time.perf_counter() - t0:.2f} s: {'all samplers match' if ok else 'MISMATCH'}")
    finally:
        ray.get([s.close.remote() for s in samplers] + [trainer.close.remote()])
        ray.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
