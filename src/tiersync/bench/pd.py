"""``tiersync bench pd``: the prefill -> decode link, the KV of one long prompt, process to process.

A prefill PROCESS (multiprocessing, spawn) holds one :class:`~tiersync.disagg.KVProducer`
with the KV of a 6000-token prompt in vLLM's CPU layout (``HEAD_MAJOR``: per layer
``[num_blocks, kv_heads, block_size, 2, head_dim]``, bfloat16-sized, the request's blocks
scattered through the pool as vLLM allocates them; both pools allocated as vLLM allocates its
KV cache, the producer's backed by memfds and both collapsed into huge pages where the kernel
can, as the connector does: :func:`engine_layers`). Each iteration registers a new request
with every layer ready and lets the producer finish what a ready layer starts (the checksums
it answers a same-host reader with, :meth:`~tiersync.disagg.KVProducer.settle`: a prefill
engine's forward overlaps them, and a decode engine reads after the prefill answered). This
process's :class:`~tiersync.disagg.KVConsumer` then reads it whole into its own pool
(``start_read`` .. DONE, every payload checksummed, landed in the request's blocks). Every
timed request has block tables of its own on both sides, as a served request has: no plan
either side made for an earlier request serves it.

Rows, each against a baseline timed in the same run, interleaved:

- ``pd-link-tcp`` (route TCP) vs ``raw-socket``: the same prefill process ``sendall`` s the
  request's bytes per layer from contiguous buffers and this process ``recv_into`` s one
  contiguous buffer (no framing, no checksum, no gather or scatter: the socket's limit).
- ``pd-link-local`` (route LOCAL: the bytes are copied out of the prefill process's memory)
  vs ``memcpy``: one-thread ``np.copyto`` of the same number of bytes, one buffer.

Before any timing the first read of each route is compared byte for byte with the
producer's KV (recomputed here from the seed); a mismatch raises RoundTripError.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from typing import Any

import numpy as np

from tiersync.bench.common import BenchConfig, RoundTripError, from_child, progress, report, row, throughput

TOKENS = {"full": 6000, "quick": 6000, "tiny": 600}
LAYERS = {"full": 32, "quick": 8, "tiny": 2}
HEADS, HEAD_DIM, BLOCK = {"full": 8, "quick": 8, "tiny": 2}, 128, 16
TOKEN = "tiersync-bench-pd-link-token-0123"


def layout(mode: str) -> Any:
    from tiersync.disagg import KVOrder, PagedKVLayout

    blocks = -(-TOKENS[mode] // BLOCK)
    return PagedKVLayout(
        num_layers=LAYERS[mode],
        num_kv_heads=HEADS[mode],
        head_dim=HEAD_DIM,
        block_size=BLOCK,
        num_blocks=blocks + blocks // 4,
        dtype="bfloat16",
        tp_size=1,
        order=KVOrder.HEAD_MAJOR,
    )


def block_ids(mode: str, seed: int) -> list[int]:
    """The request's blocks, scattered through the pool (vLLM's free list is not in order)."""
    lay = layout(mode)
    rng = np.random.default_rng([seed, 1])
    return rng.permutation(lay.num_blocks)[: -(-TOKENS[mode] // BLOCK)].tolist()


def source_layers(mode: str, seed: int) -> list[np.ndarray]:
    lay = layout(mode)
    rng = np.random.default_rng([seed, 2])
    return [rng.integers(0, 256, lay.layer_nbytes, dtype=np.uint8) for _ in range(lay.num_layers)]


def engine_layers(
    mode: str, fill: list[np.ndarray] | None = None, share: bool = False
) -> tuple[list[np.ndarray], Any, str]:
    """One buffer per layer allocated as vLLM's CPU backend allocates its KV cache (``torch.zeros``:
    4 KiB pages; numpy where torch is absent), ``fill[l]`` copied in, then made what the connector
    makes them when it registers them, long before a request: with ``share`` (a producer's,
    ``share_kv``) backed by sealed memfds (:func:`~tiersync.tiers.shareable.share_all`), then
    collapsed into huge pages where the kernel can (``huge_pages``,
    :class:`~tiersync.tiers.huge_pages.Collapser`). Returns them, the shared regions and what
    it got, for the row."""
    from tiersync.tiers.huge_pages import Collapser
    from tiersync.tiers.shareable import share_all

    lay = layout(mode)
    try:
        import torch

        out, how = [torch.zeros(lay.layer_nbytes, dtype=torch.uint8).numpy() for _ in range(lay.num_layers)], "torch"
    except ImportError:
        out, how = [np.zeros(lay.layer_nbytes, np.uint8) for _ in range(lay.num_layers)], "numpy (no torch)"
    for buf, src in zip(out, fill or []):
        buf[:] = src
    shared = share_all(out) if share else ()
    collapser = Collapser(out)
    collapser.done.wait()
    total = lay.layer_nbytes * lay.num_layers / 1e6
    got = f"{how}, {sum(r.nbytes for r in shared) / 1e6:.0f} of {total:.0f} MB shared, "
    return out, shared, got + f"{collapser.collapsed / 1e6:.0f} MB collapsed"


def route_spans(mode: str, seed: int, dst_ids: list[int]) -> np.ndarray:
    from tiersync.disagg.reshard import default_planner

    lay = layout(mode)
    return default_planner().plan(lay, lay, block_ids(mode, seed), dst_ids, TOKENS[mode]).route_spans(0, 0)


# -- the prefill process -------------------------------------------------------------------
def _prefill(mode: str, seed: int, dst_ids: list[int], conn: Any) -> None:
    """Commands over ``conn``: ("register", rid, table_seed) -> "ok" (the request's blocks are
    ``block_ids(mode, table_seed)``); ("stop",). Also serves the raw baseline: each connection's
    b"go" is answered with every layer's route bytes."""
    from tiersync.disagg import DisaggConfig, KVProducer
    from tiersync.disagg.spanio import gather

    lay = layout(mode)
    layers, shared, memory = engine_layers(mode, source_layers(mode, seed), share=True)
    spans = route_spans(mode, seed, dst_ids)
    raw = [gather(layer, spans[:, 0], spans[:, 2]) for layer in layers]
    listener = socket.create_server(("127.0.0.1", 0))
    producer = KVProducer(lay, 0, DisaggConfig(token=TOKEN, timeout_s=120), shared=shared)
    import threading

    threading.Thread(target=_raw_server, args=(listener, raw), daemon=True).start()
    conn.send((producer.address, f"127.0.0.1:{listener.getsockname()[1]}", memory))
    while True:
        cmd = conn.recv()
        producer.poll()  # forget what finished (the buffers are shared by every request)
        if cmd[0] == "stop":
            producer.close()
            return
        producer.register(cmd[1], block_ids(mode, cmd[2]), TOKENS[mode], layers)
        for layer in range(lay.num_layers):
            producer.layer_ready(cmd[1], layer)
        producer.settle(cmd[1])  # the sums a prefill's forward would have overlapped
        conn.send("ok")


def _raw_server(listener: socket.socket, raw: list[np.ndarray]) -> None:
    while True:
        sock, _ = listener.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with sock:
            while sock.recv(2) == b"go":
                for buf in raw:
                    sock.sendall(buf)


# -- contenders ------------------------------------------------------------------------------
class _Link:
    """The consumer of one route: each ``run`` reads a newly registered request whole."""

    def __init__(self, mode: str, conn: Any, proc: Any, address: str, route: str) -> None:
        from tiersync.disagg import DisaggConfig, KVConsumer

        self.mode, self.conn, self.proc, self.address, self.route = mode, conn, proc, address, route
        self.layout = layout(mode)
        self.consumer = KVConsumer(self.layout, 0, DisaggConfig(token=TOKEN, route=route, timeout_s=120))
        self.landing, _, self.memory = engine_layers(mode)
        self.n = 0

    def prepare(self, seed: int) -> str:
        """Register a request whose blocks in the prefill pool are ``block_ids(mode, seed)``."""
        self.n += 1
        rid = f"{self.route}-{self.n}"
        self.conn.send(("register", rid, seed))
        if from_child(self.conn, self.proc, "prefill", 120) != "ok":
            raise RoundTripError("the prefill process did not register the request")
        return rid

    def run(self, rid: str, seed: int, dst_ids: list[int]) -> None:
        from tiersync.disagg import RequestState, SourceSpec

        source = SourceSpec(self.layout, (self.address,), tuple(block_ids(self.mode, seed)), TOKENS[self.mode])
        handle = self.consumer.start_read(rid, source, dst_ids, self.landing)
        if handle.wait() is not RequestState.DONE:
            raise RoundTripError(f"pd-link-{self.route}: the read failed: {handle.error}")
        self.consumer.poll()


class _Raw:
    def __init__(self, address: str, nbytes: int) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = memoryview(bytearray(nbytes))

    def run(self) -> None:
        self.sock.sendall(b"go")
        got = 0
        while got < len(self.buf):
            n = self.sock.recv_into(self.buf[got:])
            if not n:
                raise RoundTripError("the raw baseline's server closed")
            got += n


# -- the suite ---------------------------------------------------------------------------------
def _expected(mode: str, seed: int, dst_ids: list[int]) -> list[np.ndarray]:
    from tiersync.disagg.spanio import gather, scatter

    lay, spans = layout(mode), route_spans(mode, seed, dst_ids)
    out = [np.zeros(lay.layer_nbytes, np.uint8) for _ in range(lay.num_layers)]
    for src, dst in zip(source_layers(mode, seed), out):
        scatter(dst, spans[:, 1], spans[:, 2], gather(src, spans[:, 0], spans[:, 2]))
    return out


def _check(link: _Link, config: BenchConfig, dst_ids: list[int], expected: list[np.ndarray]) -> None:
    for buf in link.landing:
        buf[:] = 0
    link.run(link.prepare(config.seed), config.seed, dst_ids)
    if config.inject_corruption:
        link.landing[0][link.landing[0].size // 2] ^= 0xFF
    bad = [i for i, (got, want) in enumerate(zip(link.landing, expected)) if not np.array_equal(got, want)]
    if bad:
        raise RoundTripError(f"pd-link-{link.route}: landed KV differs from the producer's", layers=bad)


def _time(config: BenchConfig, link: _Link, baseline: Any, bar: Any) -> tuple[list, list]:
    """Interleaved timings; each request of ours has new block tables on both sides (seeds no
    other request of the run uses), so each pays the planning a served request pays."""
    ours, base = [], []
    for it in range(config.n_warmups + config.n_iterations):
        src_seed = config.seed + 1000 + it
        dst_ids = block_ids(config.mode, config.seed + 100_000 + it)
        rid = link.prepare(src_seed)  # registering is the prefill engine's work, not the link's
        order = [0, 1] if it % 2 == 0 else [1, 0]
        for which in order:
            t0 = time.perf_counter()
            link.run(rid, src_seed, dst_ids) if which == 0 else baseline()
            dt = time.perf_counter() - t0
            if it >= config.n_warmups:
                (ours if which == 0 else base).append(dt)
        bar.update(1)
    return ours, base


def _case(
    config: BenchConfig, conn: Any, proc: Any, addrs: tuple[str, str, str], route: str, bar: Any
) -> dict[str, Any]:
    mode = config.mode
    lay, dst_ids = layout(mode), block_ids(mode, config.seed + 7)
    nbytes = int(route_spans(mode, config.seed, dst_ids)[:, 2].sum()) * lay.num_layers
    link = _Link(mode, conn, proc, addrs[0], route)
    try:
        _check(link, config, dst_ids, _expected(mode, config.seed, dst_ids))
        if route == "tcp":
            raw = _Raw(addrs[1], nbytes)
            baseline, name, detail = raw.run, "raw-socket", "prefill process sendall of the same bytes, recv_into"
        else:
            src = np.random.default_rng(config.seed).integers(0, 256, nbytes, dtype=np.uint8)
            dst = np.empty_like(src)
            baseline, name, detail = (lambda: np.copyto(dst, src)), "memcpy", "one-thread np.copyto, one buffer"
        ours, base = _time(config, link, baseline, bar)
    finally:
        link.consumer.close()
    return row(
        f"pd-link-{route}",
        throughput(nbytes, ours),
        name,
        throughput(nbytes, base),
        nbytes=nbytes,
        tokens=TOKENS[mode],
        layers=lay.num_layers,
        layout=f"vLLM CPU {lay.order.value} {lay.dtype}",
        memory=f"producer: {addrs[2]}; consumer: {link.memory}",
        route=route,
        baseline_detail=detail,
        server="separate process (spawn)",
        roundtrip="ok",
        block_tables="new on both sides for every request",
        payload_checksum="every DATA frame / every same-host region",
    )


def run(config: BenchConfig) -> dict[str, Any]:
    t0 = time.perf_counter()
    routes = [r for r in ("tcp", "local") if config.cases is None or config.cases in f"pd-link-{r}"]
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(
        target=_prefill, args=(config.mode, config.seed, block_ids(config.mode, config.seed + 7), child), daemon=True
    )
    proc.start()
    child.close()
    results = []
    try:
        addrs = from_child(conn, proc, "prefill", 120)
        with progress(len(routes) * (config.n_warmups + config.n_iterations), config.progress, "bench pd") as bar:
            for route in routes:
                results.append(_case(config, conn, proc, addrs, route, bar))
        conn.send(("stop",))
        proc.join(30)
        if proc.exitcode is None:
            raise RoundTripError("the prefill process did not exit within 30 s of stop")
        if proc.exitcode != 0:  # e.g. an abort at exit: a defect the numbers must not hide
            raise RoundTripError("the prefill process did not exit cleanly", exitcode=proc.exitcode)
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    targets = {"pd-link-tcp": 0.8, "pd-link-local": 0.6}
    return report(
        config,
        results,
        roundtrip={"ok": True, "cases": len(results)},
        target={
            r["name"]: {"min_ratio": targets[r["name"]], "ratio": r["ratio"], "met": r["ratio"] >= targets[r["name"]]}
            for r in results
        },
        elapsed_s=round(time.perf_counter() - t0, 3),
    )
