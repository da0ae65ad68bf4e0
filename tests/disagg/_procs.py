"""A prefill child process hosting one KVProducer per rank, driven over a multiprocessing pipe."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))


def producer_main(layout_dict, ranks, config_kwargs, conn, share=False, ports=None) -> None:
    """Commands: ("register", rid, ids, ntok, seed), ("ready", rid, layers), ("poll",), ("stop",).
    ``share``: each rank serves one pool per layer backed by memfds (``share_all``, as the vLLM
    connector's producer does), every request's KV copied into it (one request at a time).
    ``ports``: each rank's port (default: any free one)."""
    import numpy as np

    from _kvsim import global_kv, shard
    from tiersync.disagg import DisaggConfig, KVProducer, PagedKVLayout
    from tiersync.tiers.shareable import share_all

    layout = PagedKVLayout.from_dict(layout_dict)
    pools = {r: [np.zeros(layout.layer_nbytes, np.uint8) for _ in range(layout.num_layers)] for r in ranks}
    shared = {r: share_all(pools[r]) if share else () for r in ranks}
    ports = ports or [0] * len(ranks)
    producers = [
        KVProducer(layout, r, DisaggConfig(**config_kwargs), shared=shared[r], port=port)
        for r, port in zip(ranks, ports)
    ]
    conn.send([p.address for p in producers])
    buffers = {}
    while True:
        cmd = conn.recv()
        if cmd[0] == "register":
            _, rid, ids, ntok, seed = cmd
            buffers[rid] = shard(layout, global_kv(layout, ntok, seed), ids, fill=0xCD)
            for r in ranks if share else ():
                for pool, layer in zip(pools[r], buffers[rid][r]):
                    pool[:] = layer
                buffers[rid][r] = pools[r]
            for p in producers:
                p.register(rid, ids, ntok, buffers[rid][p.rank])
            conn.send("ok")
        elif cmd[0] == "ready":
            _, rid, layers = cmd
            conn.send([[p.layer_ready(rid, layer) for layer in layers] for p in producers])
        elif cmd[0] == "poll":
            statuses = [p.poll() for p in producers]
            conn.send([(set(s.done_sending), set(s.failed_sending)) for s in statuses])
        elif cmd[0] == "stop":
            for p in producers:
                p.close()
            conn.send("bye")
            return


class ProducerProcess:
    """Spawned prefill process; ``addresses`` of its ranks; methods mirror the commands."""

    def __init__(self, layout, ranks, share=False, ports=None, **config_kwargs) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=producer_main, args=(layout.to_dict(), list(ranks), config_kwargs, child, share, ports), daemon=True
        )
        self.proc.start()
        if not self.conn.poll(60):
            raise RuntimeError("producer child did not start")
        self.addresses = self.conn.recv()
        self._finals: dict[str, dict[int, str]] = {}  # request -> rank -> "done"/"failed", not yet waited for

    def _call(self, *cmd):
        self.conn.send(cmd)
        if not self.conn.poll(30):
            raise RuntimeError(f"producer child did not answer {cmd[0]}")
        return self.conn.recv()

    def register(self, rid, ids, ntok, seed=0):
        return self._call("register", rid, list(ids), ntok, seed)

    def ready(self, rid, layers):
        return self._call("ready", rid, list(layers))

    def wait_final(self, rid, timeout=30.0):
        """Poll until every rank reported ``rid``; returns the per-rank "done"/"failed". A poll
        drains the ranks' reports: those of other requests are kept for their own wait_final."""
        end = time.monotonic() + timeout
        while True:
            for i, (done, failed) in enumerate(self._call("poll")):
                for other in done | failed:
                    self._finals.setdefault(other, {})[i] = "done" if other in done else "failed"
            seen = self._finals.get(rid, {})
            if len(seen) == len(self.addresses):
                del self._finals[rid]
                return [seen[i] for i in range(len(self.addresses))]
            if time.monotonic() >= end:
                raise AssertionError(f"producer never finished {rid}: {seen}")
            time.sleep(0.05)  # polling the child's status, not synchronising on time

    def kill(self):
        self.proc.kill()
        self.proc.join(10)

    def stop(self):
        if self.proc.is_alive():
            try:
                self._call("stop")
            except (RuntimeError, EOFError, OSError):
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.kill()
