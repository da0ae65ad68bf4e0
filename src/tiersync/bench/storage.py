"""Storage-tier benchmark: batched 64 KiB blocks through :class:`StorageTier` vs raw file I/O.

Same directory, same run, same bytes, same memory. One iteration writes ``blocks``
blocks as ``batches`` concurrent write batches (the tier packs batches queued together
into segments of up to ``segment_bytes``; fsynced, renamed, directory fsynced — its
full durability path) and, as the baseline, ``os.write`` of the same bytes to one new
file + ``fsync``; then reads them back as ``batches`` concurrent read requests vs one
sequential buffered ``readv`` of the raw file. Reads are COLD on both sides: every file
is dropped from the page cache with ``posix_fadvise(DONTNEED)`` right before it is
read, and the bench checks with ``mincore`` that nothing of either side is resident
(``resident_bytes_before_reads``, 0 expected). The tier reads with O_DIRECT when the
file system and alignment allow it and verifies every block's xxh3_64 checksum; the
baseline does not verify. Both sides use buffers made like the host tier's memory
(anonymous mapping with ``MADV_HUGEPAGE``). Each row also reports, for information,
the raw file written / read with O_DIRECT from / into the same buffer
(``raw_direct_gbps``: a stricter baseline than the buffered one the ratio uses). Iterations
interleave the timings (order rotating); rows report medians, plus the median and 10th/90th
percentiles of the per-iteration ratio (``paired_ratio*``). A byte-exact round trip of both
paths runs first and the bench refuses to report on a mismatch.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import tempfile
import time

import numpy as np

from tiersync.bench.common import (
    BenchConfig,
    RoundTripError,
    median,
    percentile,
    report,
    row,
    throughput,
)
from tiersync.tiers.storage import ReadStatus, StorageConfig, StorageTier

BLOCK = 64 << 10
IDENT = b"tiersync-bench!!"


def run(quick: bool | BenchConfig, directory: str | None = None) -> dict:
    """Run the bench in ``directory`` (a temp dir inside it; None = the system temp dir).

    ``quick`` may be a :class:`BenchConfig` (``tiersync bench storage``). Returns the
    :func:`~tiersync.bench.common.report` object, one row each for write and read.
    Raises :class:`RoundTripError` instead of reporting when a round trip is not exact.
    """
    config = quick if isinstance(quick, BenchConfig) else BenchConfig(suite="storage", quick=bool(quick))
    blocks, batches = {"tiny": (32, 2), "quick": (256, 4), "full": (1024, 8)}[config.mode]
    iters, warm = config.n_iterations, config.n_warmups
    base = tempfile.mkdtemp(prefix="tiersync-bench-storage-", dir=directory)
    src, dst = _host_buffer(blocks * BLOCK), _host_buffer(blocks * BLOCK)
    s = np.frombuffer(src, dtype=np.uint8)
    s[:] = np.random.default_rng(config.seed).integers(0, 256, s.size, dtype=np.uint8)
    tier = StorageTier(StorageConfig(os.path.join(base, "tier"), IDENT, workers=4))
    try:
        _check(tier, base, src, dst, blocks, batches, config.inject_corruption)
        times: dict[str, list[float]] = {k: [] for k in ("ours_w", "raw_w", "direct_w", "ours_r", "raw_r", "direct_r")}
        resident = 0
        for i in range(warm + iters):
            s[::BLOCK] = i & 0xFF  # change the data before each iteration
            sample, res = _iteration(tier, base, src, dst, blocks, batches, i)
            resident = max(resident, res)
            if i >= warm:
                for k, v in sample.items():
                    times[k].append(v)
        nbytes, extra = blocks * BLOCK, _extra(tier, blocks, batches, resident)
        results = [
            row(
                "storage_write_64k",
                throughput(nbytes, times["ours_w"]),
                "os.write + fsync, one file",
                throughput(nbytes, times["raw_w"]),
                **_paired(times["raw_w"], times["ours_w"]),
                raw_direct_gbps=round(throughput(nbytes, times["direct_w"])["gbps"], 4),
                **extra,
            ),
            row(
                "storage_read_64k",
                throughput(nbytes, times["ours_r"]),
                "sequential read, one file",
                throughput(nbytes, times["raw_r"]),
                **_paired(times["raw_r"], times["ours_r"]),
                raw_direct_gbps=round(throughput(nbytes, times["direct_r"])["gbps"], 4),
                **extra,
            ),
        ]
        return report(
            config,
            results,
            directory=directory or tempfile.gettempdir(),
            checked_bytes=2 * nbytes,
            cache="cold: posix_fadvise(DONTNEED) on every file of both sides before reading, checked with mincore",
        )
    finally:
        tier.close()
        shutil.rmtree(base, ignore_errors=True)


def _extra(tier: StorageTier, blocks: int, batches: int, resident: int) -> dict:
    return {
        "block_bytes": BLOCK,
        "blocks": blocks,
        "batches": batches,
        "segment_bytes": tier.config.segment_bytes,
        "direct_reads": tier.stats().direct_io,
        "direct_writes": tier.config.direct_writes,
        "resident_bytes_before_reads": resident,
    }


def _paired(raw: list[float], ours: list[float]) -> dict:
    """Per-iteration ratios ours/raw (throughput = inverse time): median and 10th/90th percentiles."""
    r = [a / b for a, b in zip(raw, ours)]
    return {
        "paired_ratio": round(median(r), 4),
        "paired_ratio_p10": round(percentile(r, 10), 4),
        "paired_ratio_p90": round(percentile(r, 90), 4),
    }


def _host_buffer(nbytes: int) -> mmap.mmap:
    """Memory made the way the host tier makes its arena (page aligned, transparent huge pages)."""
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    return buf


def _keys(i: int, blocks: int) -> list[bytes]:
    return [i.to_bytes(8, "little") + j.to_bytes(8, "little") for j in range(blocks)]


def _views(buf: mmap.mmap, blocks: int) -> list[memoryview]:
    mv = memoryview(buf)
    return [mv[j * BLOCK : (j + 1) * BLOCK] for j in range(blocks)]


def _ours_write(tier, src, keys, batches) -> float:
    views, per = _views(src, len(keys)), len(keys) // batches
    t0 = time.perf_counter()
    futs = [tier.write(keys[b * per : (b + 1) * per], views[b * per : (b + 1) * per]) for b in range(batches)]
    for f in futs:
        f.result()
    return time.perf_counter() - t0


def _ours_read(tier, dst, keys, batches) -> tuple[float, list[ReadStatus]]:
    _cold([os.path.join(tier.directory, n) for n in os.listdir(tier.directory)])
    views, per = _views(dst, len(keys)), len(keys) // batches
    t0 = time.perf_counter()
    futs = [tier.read(keys[b * per : (b + 1) * per], views[b * per : (b + 1) * per]) for b in range(batches)]
    st = [s for f in futs for s in f.result()]
    return time.perf_counter() - t0, st


def _raw_write(path, src, direct: bool = False) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (getattr(os, "O_DIRECT", 0) if direct else 0), 0o644)
    try:
        mv, off = memoryview(src), 0
        while off < len(mv):
            off += os.write(fd, mv[off:])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def _raw_read(path, dst, direct: bool = False) -> float:
    _cold([path])
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0))
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


_ORDER = ("ours_r", "raw_r", "direct_r")


def _iteration(tier, base, src, dst, blocks, batches, i) -> tuple[dict[str, float], int]:
    """One sample of every timing (orders rotating with ``i``) and the most bytes found
    resident in the page cache right before a timed read (0 = every read was cold)."""
    keys, raw = _keys(i, blocks), os.path.join(base, f"raw-{i}.bin")
    out: dict[str, float] = {}
    steps = [
        ("ours_w", lambda: _ours_write(tier, src, keys, batches)),
        ("raw_w", lambda: _raw_write(raw, src)),
        ("direct_w", lambda: _raw_write(raw + ".direct", src, direct=True)),
    ]
    k = i % len(steps)
    for name, fn in steps[k:] + steps[:k]:
        out[name] = fn()
    os.unlink(raw + ".direct")
    segs = [os.path.join(tier.directory, n) for n in os.listdir(tier.directory)]
    reads = {
        "ours_r": (segs, lambda: _ours_read(tier, dst, keys, batches)[0]),
        "raw_r": ([raw], lambda: _raw_read(raw, dst)),
        "direct_r": ([raw], lambda: _raw_read(raw, dst, direct=True)),
    }
    k, resident = i % len(_ORDER), 0
    for name in _ORDER[k:] + _ORDER[:k]:
        files, fn = reads[name]
        resident = max(resident, _cold(files))  # what the timed read will find cached (it drops again)
        out[name] = fn()
    tier.delete(keys)
    os.unlink(raw)
    return out, resident


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


def _cold(paths: list[str]) -> int:
    """Drop ``paths`` from the page cache; returns the bytes of them still resident after that."""
    for p in paths:
        _drop_cache(p)
    return sum(max(_resident_bytes(p), 0) for p in paths)


def _resident_bytes(path: str) -> int:
    """Bytes of ``path`` in the page cache (``mincore``); -1 when it cannot be told."""
    try:
        size = os.path.getsize(path)
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return -1
    try:
        if size == 0:
            return 0
        page = mmap.PAGESIZE
        vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m:
            view = np.frombuffer(m, dtype=np.uint8)
            rc = ctypes.CDLL(None).mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec)
            del view
        return -1 if rc else int((np.frombuffer(vec, dtype=np.uint8) & 1).sum()) * page
    finally:
        os.close(fd)
