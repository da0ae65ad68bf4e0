"""Storage-tier benchmark: batched 64 KiB blocks through :class:`StorageTier` vs raw file I/O.

Same directory, same run, same bytes. One iteration writes ``blocks`` blocks as
``batches`` write batches (one segment each, fsynced, renamed, directory fsynced — the
tier's full durability path, batches in flight on its worker pool) and, as the
baseline, ``os.write`` of the same bytes to one new file + ``fsync``. Reads are COLD on
both sides: every file is dropped from the page cache with ``posix_fadvise(DONTNEED)``
before it is read (the tier also uses O_DIRECT when the file system allows it); the
tier verifies every block's xxh3_64 checksum, the baseline does not. Iterations
interleave the four timings (order alternating); rows report medians. A byte-exact
round trip of both paths runs first and the bench refuses to report on a mismatch.
"""
from __future__ import annotations

import mmap
import os
import shutil
import tempfile
import time

import numpy as np

from tiersync.bench.common import BenchConfig, RoundTripError, report, row, throughput
from tiersync.tiers.storage import ReadStatus, StorageConfig, StorageTier

BLOCK = 64 << 10
IDENT = b"tiersync-bench!!"


def run(quick: "bool | BenchConfig", directory: str | None = None) -> dict:
    """Run the bench in ``directory`` (a temp dir inside it; None = the system temp dir).

    ``quick`` may be a :class:`BenchConfig` (``tiersync bench storage``). Returns the
    :func:`~tiersync.bench.common.report` object, one row each for write and read.
    Raises :class:`RoundTripError` instead of reporting when a round trip is not exact.
    """
    config = quick if isinstance(quick, BenchConfig) else BenchConfig(suite="storage", quick=bool(quick))
    blocks, batches = {"tiny": (32, 2), "quick": (256, 4), "full": (1024, 8)}[config.mode]
    iters, warm = config.n_iterations, config.n_warmups
    base = tempfile.mkdtemp(prefix="tiersync-bench-storage-", dir=directory)
    src, dst = mmap.mmap(-1, blocks * BLOCK), mmap.mmap(-1, blocks * BLOCK)  # page aligned
    s = np.frombuffer(src, dtype=np.uint8)
    s[:] = np.random.default_rng(config.seed).integers(0, 256, s.size, dtype=np.uint8)
    tier = StorageTier(StorageConfig(os.path.join(base, "tier"), IDENT, workers=4))
    try:
        _check(tier, base, src, dst, blocks, batches, config.inject_corruption)
        times: dict[str, list[float]] = {"ours_w": [], "raw_w": [], "ours_r": [], "raw_r": []}
        for i in range(warm + iters):
            s[:: BLOCK] = i & 0xFF  # change the data before each iteration
            sample = _iteration(tier, base, src, dst, blocks, batches, i, flip=bool(i % 2))
            if i >= warm:
                for k, v in sample.items():
                    times[k].append(v)
        nbytes, extra = blocks * BLOCK, _extra(tier, blocks, batches)
        results = [
            row("storage_write_64k", throughput(nbytes, times["ours_w"]), "os.write + fsync, one file",
                throughput(nbytes, times["raw_w"]), **extra),
            row("storage_read_64k", throughput(nbytes, times["ours_r"]), "sequential read, one file",
                throughput(nbytes, times["raw_r"]), **extra),
        ]
        return report(config, results, directory=directory or tempfile.gettempdir(), checked_bytes=2 * nbytes,
                      cache="cold: posix_fadvise(DONTNEED) on every file of both sides before reading")
    finally:
        tier.close()
        shutil.rmtree(base, ignore_errors=True)


def _extra(tier: StorageTier, blocks: int, batches: int) -> dict:
    return {"block_bytes": BLOCK, "blocks": blocks, "batches": batches,
            "direct_reads": tier.stats().direct_io, "direct_writes": tier.config.direct_writes}


def _keys(i: int, blocks: int) -> list[bytes]:
    return [i.to_bytes(8, "little") + j.to_bytes(8, "little") for j in range(blocks)]


def _views(buf: mmap.mmap, blocks: int) -> list[memoryview]:
    mv = memoryview(buf)
    return [mv[j * BLOCK:(j + 1) * BLOCK] for j in range(blocks)]


def _ours_write(tier, src, keys, batches) -> float:
    views, per = _views(src, len(keys)), len(keys) // batches
    t0 = time.perf_counter()
    futs = [tier.write(keys[b * per:(b + 1) * per], views[b * per:(b + 1) * per]) for b in range(batches)]
    for f in futs:
        f.result()
    return time.perf_counter() - t0


def _ours_read(tier, dst, keys, batches) -> tuple[float, list[ReadStatus]]:
    for name in os.listdir(tier.directory):
        _drop_cache(os.path.join(tier.directory, name))
    views, per = _views(dst, len(keys)), len(keys) // batches
    t0 = time.perf_counter()
    futs = [tier.read(keys[b * per:(b + 1) * per], views[b * per:(b + 1) * per]) for b in range(batches)]
    st = [s for f in futs for s in f.result()]
    return time.perf_counter() - t0, st


def _raw_write(path, src) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        mv, off = memoryview(src), 0
        while off < len(mv):
            off += os.write(fd, mv[off:])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def _raw_read(path, dst) -> float:
    _drop_cache(path)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        mv, off = memoryview(dst), 0
        while off < len(mv):
            n = os.readv(fd, [mv[off:]])
            if n == 0:
                break
            off += n
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def _iteration(tier, base, src, dst, blocks, batches, i, flip) -> dict[str, float]:
    keys, raw = _keys(i, blocks), os.path.join(base, f"raw-{i}.bin")
    out: dict[str, float] = {}
    steps = [("ours_w", lambda: _ours_write(tier, src, keys, batches)), ("raw_w", lambda: _raw_write(raw, src))]
    for name, fn in (reversed(steps) if flip else steps):
        out[name] = fn()
    reads = [("ours_r", lambda: _ours_read(tier, dst, keys, batches)[0]), ("raw_r", lambda: _raw_read(raw, dst))]
    for name, fn in (reversed(reads) if flip else reads):
        out[name] = fn()
    tier.delete(keys)
    os.unlink(raw)
    return out


def _check(tier, base, src, dst, blocks, batches, corrupt: bool) -> None:
    keys, raw = _keys(1 << 40, blocks), os.path.join(base, "raw-check.bin")
    _ours_write(tier, src, keys, batches)
    if corrupt:  # tests only: a flipped byte on disk must make the bench refuse
        seg = sorted(n for n in os.listdir(tier.directory) if n.endswith(".seg"))[0]
        with open(os.path.join(tier.directory, seg), "r+b") as f:
            f.seek(-100, os.SEEK_END)
            f.write(b"\xff")
    _, st = _ours_read(tier, dst, keys, batches)
    if any(s is not ReadStatus.OK for s in st) or dst[:] != src[:]:
        raise RoundTripError("storage tier round trip is not byte-exact; refusing to report")
    memoryview(dst)[:] = b"\0" * len(dst)
    _raw_write(raw, src)
    _raw_read(raw, dst)
    if dst[:] != src[:]:
        raise RoundTripError("raw file round trip is not byte-exact; refusing to report")
    tier.delete(keys)
    os.unlink(raw)


def _drop_cache(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
