"""Child processes of ``tiersync bench weights`` (spawned; each one contender's receiver).

- :func:`model_shapes`/:func:`make_tensor`: the bench model, shaped like a Llama-style
  transformer in bf16, generated deterministically per tensor (so a gloo trainer process
  rebuilds the same bytes from the seed instead of receiving them).
- :func:`worker_main`: one sampler process, reused by every case: a tiersync
  :class:`~tiersync.weights.receiver.WeightReceiver` when told to join, or a raw loopback
  socket receiver (``recv_into`` of the whole model).
- :func:`gloo_main`: one rank of ``torch.distributed`` over gloo (trainers broadcast their
  shard of every tensor, receivers hold the whole model).

Every receiver answers a digest request with the xxh3_64 of each tensor it holds, which the
driver compares with the source before any number is reported.
"""

from __future__ import annotations

import gc
import socket
import time
from typing import Any

import numpy as np
import xxhash

# (hidden, intermediate, layers, kv_dim, vocab): Llama-3.2-1B-like with a 32k vocabulary.
SHAPES = {"full": (2048, 8192, 16, 512, 32000), "quick": (1024, 4096, 6, 256, 32000), "tiny": (256, 1024, 2, 64, 4000)}


def model_shapes(mode: str, layers: int | None = None) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape in state_dict order (tied embedding, bf16 everywhere)."""
    h, f, n, kv, vocab = SHAPES[mode]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(n if layers is None else layers):
        p = f"model.layers.{i}."
        out.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (h, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, h),
                p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate_proj.weight": (f, h),
                p + "mlp.up_proj.weight": (f, h),
                p + "mlp.down_proj.weight": (h, f),
            }
        )
    out["model.norm.weight"] = (h,)
    return out


def make_tensor(seed: int, index: int, shape: tuple[int, ...]) -> np.ndarray:
    """Deterministic pseudo-random bf16 bits (uint16) of ``shape`` for tensor ``index``."""
    rng = np.random.default_rng([seed, index])
    n = int(np.prod(shape))
    return rng.integers(0, 1 << 16, n, dtype=np.uint16).reshape(shape)


def stamp(arr: np.ndarray, version: int) -> None:
    """Change the data before each publish: the first 8 bytes carry the version."""
    flat = arr.reshape(-1).view(np.uint8)
    flat[:8] = np.frombuffer(int(version).to_bytes(8, "little"), np.uint8)[: min(8, flat.size)]


def digest(arr: Any) -> int:
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))


def shard_rows(rows: int, shards: int, s: int) -> tuple[int, int]:
    """Dim-0 interval of trainer shard ``s`` (the planner's rule: remainder to the last)."""
    step = rows // shards
    return s * step, rows if s == shards - 1 else (s + 1) * step


# -- the sampler pool: tiersync receivers and raw socket receivers ------------------
def worker_main(conn: Any) -> None:
    """One sampler process for the whole run; commands over ``conn``:

    ``("join", addresses, rank, count, transport, buffers, zero_copy[, delta])`` -> ``("ready", transports)``
    (``delta`` False unless given: the full-sync rows move every byte of every version);
    ``("digest", version)`` -> ``("digest", version, {name: xxh3})``; ``("leave",)`` -> ``("left",)``;
    ``("raw", port, nbytes)`` -> ``("ready",)``, then ``("round",)`` receives one model and
    answers one byte on the socket, ``("rawdigest",)`` -> ``("digest", xxh3)``, ``("rawclose",)``;
    ``("trim",)`` frees the arrays kept for reuse; ``("stop",)`` ends the process.
    """
    rec, raw, arena = None, None, _Arena()
    while True:
        cmd = conn.recv()
        op = cmd[0]
        if op == "join":
            arena.reset()
            rec = _join(arena, *cmd[1:])
            conn.send(("ready", [t.value for t in rec.transports()]))
        elif op == "digest":
            rec.receive(cmd[1]).result(600)
            with rec.acquire(60) as lease:
                conn.send(("digest", lease.version, {n: digest(a) for n, a in lease.tensors.items()}))
        elif op == "leave":
            rec.close()
            rec = None
            gc.collect()  # the receiver sits in reference cycles (threads): free its memory now
            conn.send(("left",))
        elif op == "raw":
            arena.reset()
            raw = _RawReceiver(cmd[1], arena((cmd[2],), "uint8"))
            conn.send(("ready",))
        elif op == "round":
            raw.round()
        elif op == "rawdigest":
            conn.send(("digest", digest(raw.buf)))
        elif op == "rawclose":
            raw.close()
            raw = None
        elif op == "trim":  # give the arena's memory back (full mode: gloo runs next)
            arena.free, arena.used = {}, {}
            gc.collect()
        else:
            return


class _Arena:
    """Weight arrays kept across joins, as a long-lived sampler keeps its memory: the page faults
    of fresh allocations are paid once per process, not once per contender."""

    def __init__(self) -> None:
        self.free: dict[tuple, list[np.ndarray]] = {}
        self.used: dict[tuple, list[np.ndarray]] = {}

    def reset(self) -> None:
        for key, arrays in self.used.items():
            self.free.setdefault(key, []).extend(arrays)
        self.used = {}

    def __call__(self, shape: tuple, dtype: str) -> np.ndarray:
        from tiersync.weights.tensors import allocate

        key = (tuple(shape), dtype)
        pool = self.free.get(key)
        arr = pool.pop() if pool else allocate(shape, dtype)
        self.used.setdefault(key, []).append(arr)
        return arr


def _join(
    arena: _Arena,
    addresses: list[str],
    rank: int,
    count: int,
    transport: str,
    buffers: int,
    zero_copy: bool = False,
    delta: bool = False,
    streams: int = 4,
) -> Any:
    from tiersync.weights.config import ReceiverConfig, TransportKind
    from tiersync.weights.receiver import WeightReceiver
    from tiersync.weights.sharding import Mesh, Sharding

    dest = Sharding.replicated(Mesh((count,), ("dp",)))
    cfg = ReceiverConfig(
        tuple(addresses),
        rank=rank,
        transport=TransportKind(transport),
        buffers=buffers,
        streams=streams,
        sampler_id=f"bench-{rank}",
        zero_copy=zero_copy,
        delta=delta,
    )
    return WeightReceiver(dest, cfg, allocator=arena)


# -- torch.distributed gloo ---------------------------------------------------------
def gloo_main(
    rank: int,
    world: int,
    trainers: int,
    store: str,
    mode: str,
    layers: int,
    seed: int,
    cases: list[tuple[int, int, list[int]]],
    conn: Any,
) -> None:
    """Rank ``rank`` of ``world``: ranks < ``trainers`` are trainer shards, the rest receivers.

    ``cases[k] = (shards, samplers, versions)``: on ``("go", k)`` the first ``shards`` trainers
    broadcast their rows of every tensor to the first ``samplers`` receivers, once per version.
    Trainer 0 answers ``("times", seconds per version)``; each receiver of the case answers
    ``("digest", version, {name: xxh3})`` after the first version. ``("stop",)`` ends.
    """
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=900)
    )
    groups = []
    for shards, n, _ in cases:  # every rank creates every group, in the same order
        receivers = list(range(trainers, trainers + n))
        groups.append(
            ([dist.new_group([s, *receivers]) for s in range(shards)], dist.new_group([*range(shards), *receivers]))
        )
    shapes = model_shapes(mode, layers)
    full = _gloo_tensors(rank, trainers, shapes, seed)
    conn.send(("ready",))
    while True:
        cmd = conn.recv()
        if cmd[0] != "go":
            break
        k = cmd[1]
        shards, n, versions = cases[k]
        if rank < shards or trainers <= rank < trainers + n:
            _gloo_case(rank, trainers, shards, shapes, full, versions, groups[k], conn)
    dist.destroy_process_group()


def _gloo_tensors(rank: int, trainers: int, shapes: dict, seed: int) -> dict[str, Any]:
    """Trainer 0 and every receiver hold the whole model; trainer r > 0 holds its rows for
    ``trainers`` shards. bf16 tensors (gloo refuses int16)."""
    import torch

    out = {}
    for i, (name, shape) in enumerate(shapes.items()):
        if rank == 0 or rank >= trainers:
            a = make_tensor(seed, i, shape) if rank == 0 else np.empty(shape, np.uint16)
        else:
            lo, hi = shard_rows(shape[0], trainers, rank)
            a = np.ascontiguousarray(make_tensor(seed, i, shape)[lo:hi])
        out[name] = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return out


def _gloo_case(
    rank: int, trainers: int, shards: int, shapes: dict, full: dict, versions: list[int], groups: tuple, conn: Any
) -> None:
    import torch
    import torch.distributed as dist

    per_shard, everyone = groups
    times = []
    for v in versions:
        if rank == 0:
            for t in full.values():
                stamp(t.view(torch.int16).numpy(), v)
        dist.barrier(group=everyone)
        t0 = time.perf_counter()
        for name, shape in shapes.items():
            for s in range(shards):
                if rank < trainers and rank != s:
                    continue
                lo, hi = shard_rows(shape[0], shards, s)
                t = full[name]
                buf = t[lo:hi] if rank >= trainers or rank == 0 else t  # trainer r > 0 holds only its rows
                dist.broadcast(buf, src=s, group=per_shard[s])
        dist.barrier(group=everyone)
        times.append(time.perf_counter() - t0)
        if v == versions[0] and rank >= trainers:
            conn.send(("digest", v, {n: digest(t.view(torch.int16).numpy()) for n, t in full.items()}))
    if rank == 0:
        conn.send(("times", times))


# -- raw loopback socket ------------------------------------------------------------
class _RawReceiver:
    """``recv_into`` of ``nbytes`` per round from the driver's raw sender; one byte back."""

    def __init__(self, port: int, buf: np.ndarray) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            self.sock.setsockopt(socket.SOL_SOCKET, opt, 16 << 20)
        self.buf = buf

    def round(self) -> None:
        view, got = memoryview(self.buf), 0
        while got < len(view):
            n = self.sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError("raw sender closed")
            got += n
        self.sock.sendall(b"k")

    def close(self) -> None:
        self.sock.close()
        self.buf = None
