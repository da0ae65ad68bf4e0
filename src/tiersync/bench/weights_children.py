"""The child processes of ``tiersync bench weights``, from the parent's side: start one
(``spawn``, a pipe to it), wait for its next message (``expect``), stop them all (``stop``), and
the gloo baseline's process group (:class:`Gloo`: trainer shards and receivers broadcasting over
``torch.distributed``; each case's digests checked before its times count).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
from typing import TYPE_CHECKING, Any

from tiersync.bench import weights_procs as procs
from tiersync.bench.common import RoundTripError, from_child

if TYPE_CHECKING:
    from tiersync.bench.weights_model import BenchModel as Model

__all__ = ["Gloo", "expect", "gloo_run", "spawn", "stop"]


def spawn(target: Any, *args: Any) -> tuple[Any, Any]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*args, child), daemon=True)
    proc.start()
    child.close()  # the parent keeps only its end: a child that dies is seen at once
    return proc, parent


def expect(conn: Any, kind: str, proc: Any, timeout: float = 600) -> tuple:
    msg = from_child(conn, proc, f"{kind} receiver", timeout)
    if msg[0] != kind:
        raise RoundTripError(f"expected {kind}, got {msg[0]}")
    return msg


def stop(children: list[tuple[Any, Any]]) -> None:
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


class Gloo:
    """gloo processes for ``cases`` = [(shards, samplers, versions)]: max shards trainers + max
    samplers receivers in one process group; :meth:`run` times case k (digests checked first)."""

    def __init__(self, model: Model, mode: str, layers: int, seed: int, cases: list) -> None:
        fd, self.store = tempfile.mkstemp(prefix="tiersync-bench-gloo-")
        os.close(fd)
        os.unlink(self.store)
        self.model, self.cases = model, cases
        self.trainers = max(c[0] for c in cases)
        world = self.trainers + max(c[1] for c in cases)
        self.children = [
            spawn(procs.gloo_main, r, world, self.trainers, self.store, mode, layers, seed, cases) for r in range(world)
        ]
        for p, c in self.children:
            expect(c, "ready", p)

    def run(self, k: int) -> list[float]:
        _shards, n, versions = self.cases[k]
        for _, c in self.children:
            c.send(("go", k))
        expected = self.model.digests(versions[0])
        for p, c in self.children[self.trainers : self.trainers + n]:
            _, _v, got = expect(c, "digest", p)
            if got != expected:
                raise RoundTripError("a gloo receiver's weights differ from the source; refusing to report")
        return expect(self.children[0][1], "times", self.children[0][0])[1][1:]

    def close(self) -> None:
        stop(self.children)
        if os.path.exists(self.store):
            os.unlink(self.store)


def gloo_run(shared: Gloo | None, model: Model, mode: str, layers: int, seed: int, cases: list, k: int):
    if shared is not None:
        return shared.run(k)
    group = Gloo(model, mode, layers, seed, [cases[k]])
    try:
        return group.run(0)
    finally:
        group.close()
