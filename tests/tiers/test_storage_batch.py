"""Batched storage I/O: queued writes share a segment, queued reads share a pass, every
block served is verified — for any mix of sizes, alignments, segments and duplicates."""

from __future__ import annotations

import errno
import mmap
import os
import random
import threading

import numpy as np
import pytest

from _storage_helpers import IDENT, block_bytes, key, open_tier, segments
from tiersync.errors import UsageError
from tiersync.tiers import storage_format as fmt
from tiersync.tiers import storage_io, storage_read
from tiersync.tiers.storage import ReadStatus, StorageConfig


def src_views(keys, nbytes):
    return [memoryview(np.frombuffer(bytearray(block_bytes(k, nbytes)), dtype=np.uint8)) for k in keys]


class Gate:
    """Hold the first call of ``obj.name`` until opened; count every call's first argument's length."""

    def __init__(self, monkeypatch, obj, name):
        self.entered, self.open, self.sizes = threading.Event(), threading.Event(), []
        real = getattr(obj, name)

        def gated(*args):
            self.sizes.append(len(args[0]))
            if len(self.sizes) == 1:
                self.entered.set()
                assert self.open.wait(10)
            return real(*args)

        monkeypatch.setattr(obj, name, gated)


@pytest.mark.parametrize("direct", [True, False])
def test_any_mix_round_trips_byte_exact(sdir, direct):
    rng = random.Random(7)
    sizes = {key(i): rng.choice([1000, 4096, 8192, 65536, 12345]) for i in range(60)}
    ks = list(sizes)
    with open_tier(sdir, direct_io=direct, segment_bytes=128 << 10) as t:
        futs = []
        for i in range(0, 60, 6):  # ten batches, several segments (128 KiB at most each)
            batch = ks[i : i + 6]
            views = [src_views([k], sizes[k])[0] for k in batch]
            futs.append((t.write(batch, views), views))
        for f, _ in futs:
            f.result(10)
        assert len(segments(sdir)) > 1
        reads = []
        for _ in range(5):  # concurrent requests: shuffled subsets, duplicates, aligned and not
            pick = rng.sample(ks, 20) + [ks[0]]
            outs = []
            for k in pick:
                n = sizes[k]
                buf = mmap.mmap(-1, max(n, 1)) if rng.random() < 0.5 else bytearray(n + 1)
                outs.append(memoryview(buf)[:n] if isinstance(buf, mmap.mmap) else memoryview(buf)[1 : n + 1])
            reads.append((pick, outs, t.read(pick, outs)))
        for pick, outs, f in reads:
            assert f.result(10) == [ReadStatus.OK] * len(pick)
            assert [bytes(o) for o in outs] == [block_bytes(k, sizes[k]) for k in pick]


def test_writes_queued_together_share_one_segment(sdir, monkeypatch):
    with open_tier(sdir, workers=1) as t:
        gate = Gate(monkeypatch, t, "_write_segment")
        ks = [key(i) for i in range(7)]
        first = t.write(ks[:1], src_views(ks[:1], 4096))
        assert gate.entered.wait(10)
        rest = [t.write(ks[i : i + 2], src_views(ks[i : i + 2], 4096)) for i in (1, 3, 5)]
        gate.open.set()
        for f in [first, *rest]:
            assert f.result(10) is None
        assert gate.sizes == [1, 6] and len(segments(sdir)) == 2
    with open_tier(sdir) as t:
        outs = [bytearray(4096) for _ in ks]
        assert t.read(ks, [memoryview(o) for o in outs]).result(10) == [ReadStatus.OK] * 7
        assert [bytes(o) for o in outs] == [block_bytes(k, 4096) for k in ks]


def test_segment_bytes_bounds_a_packed_segment(sdir, monkeypatch):
    with open_tier(sdir, workers=1, segment_bytes=2 * 4096) as t:
        gate = Gate(monkeypatch, t, "_write_segment")
        ks = [key(i) for i in range(5)]
        futs = [t.write(ks[:1], src_views(ks[:1], 4096))]
        assert gate.entered.wait(10)
        futs += [t.write([k], src_views([k], 4096)) for k in ks[1:]]
        gate.open.set()
        for f in futs:
            f.result(10)
        assert gate.sizes == [1, 2, 2]


def test_a_failed_packed_write_fails_every_request_and_indexes_nothing(sdir, monkeypatch):
    with open_tier(sdir, workers=1) as t:
        gate = Gate(monkeypatch, t, "_write_segment")
        ks = [key(i) for i in range(3)]
        first = t.write(ks[:1], src_views(ks[:1], 4096))
        assert gate.entered.wait(10)

        def denied(*a, **k):
            raise PermissionError(errno.EACCES, "Permission denied")

        later = [t.write([k], src_views([k], 4096)) for k in ks[1:]]
        monkeypatch.setattr(storage_io, "open_for_write", denied)
        gate.open.set()
        for f in [first, *later]:
            with pytest.raises(UsageError):
                f.result(10)
        assert t.keys() == [] and not os.listdir(sdir)


def test_reads_queued_together_share_one_pass(sdir, monkeypatch):
    ks = [key(i) for i in range(6)]
    with open_tier(sdir) as t:
        for k in ks:  # one segment each
            t.write([k], src_views([k], 4096)).result(10)
        calls = []
        entered = [threading.Event(), threading.Event()]
        release = threading.Event()
        real = storage_read.ReadPass.run

        def run(self):
            calls.append(len(self.requests))
            if len(calls) <= 2:  # hold both passes that may run at once
                entered[len(calls) - 1].set()
                assert release.wait(10)
            return real(self)

        monkeypatch.setattr(storage_read.ReadPass, "run", run)
        outs = [bytearray(4096) for _ in ks]
        futs = []
        for j in range(2):  # a lone read starts a pass at once
            futs.append(t.read(ks[j : j + 1], [memoryview(outs[j])]))
            assert entered[j].wait(10)
        futs += [t.read([k], [memoryview(o)]) for k, o in zip(ks[2:], outs[2:])]
        release.set()
        assert [f.result(10) for f in futs] == [[ReadStatus.OK]] * 6
        assert calls == [1, 1, 4]  # the four queued meanwhile: one pass
        assert [bytes(o) for o in outs] == [block_bytes(k, 4096) for k in ks]


def test_direct_refused_mid_read_falls_back_to_buffered(sdir, monkeypatch):
    ks = [key(i) for i in range(4)]
    with open_tier(sdir, direct_io=True) as t:
        t.write(ks, src_views(ks, 4096)).result(10)
        real = storage_io.read_run
        calls = []

        def picky(fd, extents, run):
            calls.append(fd)
            if len(calls) == 1:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real(fd, extents, run)

        monkeypatch.setattr(storage_io, "read_run", picky)
        outs = [mmap.mmap(-1, 4096) for _ in ks]
        assert t.read(ks, [memoryview(o) for o in outs]).result(10) == [ReadStatus.OK] * 4
        assert [o[:] for o in outs] == [block_bytes(k, 4096) for k in ks]
        assert not t.stats().direct_io and len(calls) == 2


def test_io_error_mid_read_is_unreadable_and_kept(sdir, monkeypatch):
    ks = [key(i) for i in range(2)]
    with open_tier(sdir) as t:
        t.write(ks, src_views(ks, 4096)).result(10)

        def broken(fd, extents, run):
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(storage_io, "read_run", broken)
        outs = [bytearray(4096) for _ in ks]
        assert t.read(ks, [memoryview(o) for o in outs]).result(10) == [ReadStatus.UNREADABLE] * 2
        monkeypatch.undo()
        assert sorted(t.keys()) == sorted(ks)
        assert t.read(ks, [memoryview(o) for o in outs]).result(10) == [ReadStatus.OK] * 2


def test_runs_merge_contiguous_records_only():
    v = [memoryview(bytearray(n)) for n in (4096, 1000, 4096, 4096)]
    ext = [(8192, v[0]), (0, v[1]), (4096, v[2]), (20480, v[3])]
    assert storage_io.runs(ext, gaps=True, max_nbytes=1 << 20) == [[1, 2, 0], [3]]
    assert storage_io.runs(ext, gaps=False, max_nbytes=1 << 20) == [[1], [2, 0], [3]]
    assert storage_io.runs(ext, gaps=True, max_nbytes=8192) == [[1, 2], [0], [3]]


def test_bad_segment_and_depth_config(sdir):
    for field in ("segment_bytes", "read_depth"):
        with pytest.raises(UsageError, match=f"StorageConfig.{field}"):
            StorageConfig(sdir, IDENT, **{field: 0})


def test_direct_write_refused_mid_file_is_rewritten_buffered(sdir, monkeypatch):
    ks = [key(i) for i in range(200)]  # 200 x 64 KiB: several pipelined chunks
    srcs = [mmap.mmap(-1, 65536) for _ in ks]
    for b, k in zip(srcs, ks):
        b[:] = block_bytes(k, 65536)
    real = storage_io.pwritev_all
    calls = []

    def picky(fd, bufs, offset):
        calls.append(offset)
        if len(calls) == 2:  # the second chunk of the O_DIRECT attempt
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, bufs, offset)

    with open_tier(sdir, direct_writes=True) as t:
        monkeypatch.setattr(storage_io, "pwritev_all", picky)
        t.write(ks, [memoryview(b) for b in srcs]).result(10)
        monkeypatch.undo()
        assert not t.stats().direct_io and len(segments(sdir)) == 1
        assert not [n for n in os.listdir(sdir) if n.startswith(fmt.TMP_PREFIX)]
    with open_tier(sdir) as t:
        outs = [bytearray(65536) for _ in ks]
        assert t.read(ks, [memoryview(o) for o in outs]).result(10) == [ReadStatus.OK] * len(ks)
        assert [bytes(o) for o in outs] == [block_bytes(k, 65536) for k in ks]
