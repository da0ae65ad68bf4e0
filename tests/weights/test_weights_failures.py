"""Sampler processes killed mid-sync (SIGKILL), restarted, and readers racing version switches."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

import tiersync
from _lines import LineChild
from _sync_helpers import digests, fsdp
from tiersync.errors import CapacityError
from tiersync.weights import Mesh, Sharding
from tiersync.weights.buffers import VersionedBuffers
from tiersync.weights.config import PublisherConfig, ReceiverConfig, SyncStatus, TransportKind
from tiersync.weights.publisher import WeightPublisher
from tiersync.weights.receiver import WeightReceiver

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT = 60


class _Child(LineChild):
    """A sampler process; its stdout lines arrive on a queue."""

    def __init__(self, address: str, rank: int, count: int, stall: int) -> None:
        super().__init__("_sampler_child.py", [address, str(rank), str(count), str(stall)], TIMEOUT)

    def version(self, v: int) -> dict[str, int]:
        while True:
            _, got, blob = self.expect("VERSION").split(" ", 2)
            if int(got) == v:
                return {k: int(x) for k, x in json.loads(blob).items()}

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(TIMEOUT)


def _model(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"layer{i}": rng.standard_normal((64, 256)).astype(np.float32) for i in range(6)}


@pytest.mark.parametrize("shm", [True, False])
def test_sampler_killed_mid_sync_others_finish_and_it_rejoins_next_version(shm):
    g = _model(0)
    pub = WeightPublisher(g, fsdp(1), config=PublisherConfig(shm=shm, segment_bytes=8 << 10, publish_timeout_s=60))
    children = [_Child(pub.address, r, 3, stall=1 if r == 2 else -1) for r in range(3)]
    try:
        for c in children:
            c.expect("READY")
        pub.wait_for_samplers(3, TIMEOUT)
        fut = pub.publish(1)
        children[2].expect("MIDSYNC")  # rank 2 holds part of version 1 and is stuck in the sync
        children[2].kill()
        res = fut.result(TIMEOUT)
        by_rank = {o.rank: o for o in res.outcomes}
        assert by_rank[0].status is SyncStatus.OK and by_rank[1].status is SyncStatus.OK
        assert by_rank[2].status is SyncStatus.DISCONNECTED and by_rank[2].error
        assert not res.ok and [o.rank for o in res.failed] == [2]
        want1 = digests(g)
        assert children[0].version(1) == want1 and children[1].version(1) == want1

        children[2] = _Child(pub.address, 2, 3, stall=-1)  # restarted: rejoins at the next version
        children[2].expect("READY")
        pub.wait_for_samplers(3, TIMEOUT)
        for a in g.values():
            a *= 2.0
        res = pub.publish(2).result(TIMEOUT)
        assert res.ok and len(res.outcomes) == 3, res
        want2 = digests(g)
        assert all(c.version(2) == want2 for c in children)
    finally:
        for c in children:
            c.kill()
        pub.close()


def _uniform_model(version: int) -> dict[str, np.ndarray]:
    return {f"t{i}": np.full((256, 1024), version, np.int32) for i in range(4)}


@pytest.mark.parametrize("buffers, transport", [(2, TransportKind.SHM), (2, TransportKind.TCP), (1, TransportKind.SHM)])
def test_concurrent_reader_never_sees_a_half_updated_model(buffers, transport):
    """Every tensor of version v holds the value v everywhere: a reader checksumming every
    tensor of each lease it holds must always find one single version, and find it unchanged
    at the end of its lease."""
    g = _uniform_model(1)
    pub = WeightPublisher(g, fsdp(1), config=PublisherConfig(segment_bytes=64 << 10))
    rec = WeightReceiver(fsdp(1), ReceiverConfig((pub.address,), transport=transport, buffers=buffers))
    pub.wait_for_samplers(1, TIMEOUT)
    stop, seen, bad = threading.Event(), set(), []

    def reader() -> None:
        while not stop.is_set():
            with rec.acquire(TIMEOUT) as lease:
                first = {n: int(a.sum(dtype=np.int64)) for n, a in lease.tensors.items()}
                values = {int(a[0, 0]) for a in lease.tensors.values()}
                expect = lease.version * 256 * 1024
                last = {n: int(a.sum(dtype=np.int64)) for n, a in lease.tensors.items()}
                if values != {lease.version} or set(first.values()) != {expect} or first != last:
                    bad.append((lease.version, values, first, last))
                seen.add(lease.version)

    try:
        assert pub.publish(1).result(TIMEOUT).ok
        rec.receive(1).result(TIMEOUT)
        thread = threading.Thread(target=reader)
        thread.start()
        for v in range(2, 9):
            for a in g.values():
                a[...] = v
            assert pub.publish(v).result(TIMEOUT).ok
            rec.receive(v).result(TIMEOUT)
        stop.set()
        thread.join(TIMEOUT)
        assert not bad, bad[:2]
        assert len(seen) >= 2  # the reader really overlapped several switches
    finally:
        stop.set()
        rec.close()
        pub.close()


def test_a_lease_pins_its_version_and_blocks_the_overwrite():
    bufs = VersionedBuffers(2)
    bufs.ensure({"w": ((4,), "int32")})
    i, sets = bufs.begin_write(1)
    sets["w"][...] = 1
    bufs.commit(i, 1)
    lease = bufs.acquire(1)
    j, sets = bufs.begin_write(1)  # the standby set is free
    sets["w"][...] = 2
    bufs.commit(j, 2)
    assert lease.version == 1 and lease.tensors["w"].tolist() == [1] * 4  # still v1
    with pytest.raises(CapacityError):
        bufs.begin_write(0.2)  # v3 would overwrite the set the lease holds
    assert bufs.version == 2 and lease.tensors["w"].tolist() == [1] * 4
    lease.release()
    k, sets = bufs.begin_write(1)
    assert k == i
    bufs.abort(k)  # a failed sync keeps the active version
    with bufs.acquire(1) as now:
        assert now.version == 2 and not now.tensors["w"].flags.writeable


def test_single_buffer_sync_waits_for_readers_and_readers_wait_for_it():
    bufs = VersionedBuffers(1)
    bufs.ensure({"w": ((2,), "int32")})
    i, _ = bufs.begin_write(1)
    bufs.commit(i, 1)
    lease = bufs.acquire(1)
    with pytest.raises(CapacityError):
        bufs.begin_write(0.2)
    lease.release()
    i, _ = bufs.begin_write(1)
    with pytest.raises(CapacityError):  # mid-sync: no version to read
        bufs.acquire(0.2)
    bufs.commit(i, 2)
    assert bufs.acquire(1).version == 2


def test_receiver_to_a_dead_trainer_fails_cleanly():
    pub = WeightPublisher(_model(1), fsdp(1))
    address = pub.address
    pub.close()
    with pytest.raises(tiersync.errors.RemoteError):
        WeightReceiver(Sharding.replicated(Mesh((1,), ("dp",))), ReceiverConfig((address,), connect_timeout_s=2))


def test_a_receiver_whose_close_fails_midway_still_ends_every_wait(monkeypatch):
    """A step of ``close`` that raises (it raced a sync mapping a segment) still fails the
    futures of versions not received and wakes lease waiters (before: they waited for ever,
    and a second ``close`` returned at once)."""
    pub = WeightPublisher(_model(1), fsdp(1))
    rec = WeightReceiver(Sharding.replicated(Mesh((1,), ("dp",))), ReceiverConfig((pub.address,)))
    try:
        waiting = rec.receive(5)

        def fails() -> None:
            raise RuntimeError("dictionary changed size during iteration")

        monkeypatch.setattr(rec._links, "close", fails)
        with pytest.raises(RuntimeError):
            rec.close()
        assert waiting.exception(10) is not None  # failed, not left pending
        with pytest.raises(tiersync.errors.ClosedError):
            rec.acquire(1)
    finally:
        monkeypatch.undo()
        rec._links.close()
        pub.close()


def test_a_publisher_the_program_never_closed_leaves_no_segment(tmp_path):
    """The README's snippet never calls close(): the interpreter's exit removes the segment
    name (it once stayed in /dev/shm, listed as unusable, one per run)."""
    script = (
        "import numpy as np\n"
        "from tiersync.weights import Mesh, PublisherConfig, Sharding, WeightPublisher\n"
        f"pub = WeightPublisher({{'w': np.ones((64, 64), np.float32)}}, Sharding(Mesh((1,), ('fsdp',)), ('fsdp',)),"
        f" config=PublisherConfig(shm_dir={str(tmp_path)!r}))\n"
        "pub.publish(1)\n"
        "import os; print(os.listdir(pub.config.shm_dir))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "tiersync-weights-" in out.stdout  # it was there while the program ran
    assert not [n for n in os.listdir(tmp_path) if n.startswith("tiersync-weights-")]


def test_samplers_that_stopped_reading_cost_a_publish_one_io_timeout_not_one_each():
    """Four registered samplers stop reading their control channels. Once their socket buffers
    are full, the publish whose ANNOUNCE no longer fits drops them after io_timeout_s, all four
    at once: its ANNOUNCEs go out in parallel (one after the other, that publish took four
    times io_timeout_s, and K such samplers K times)."""
    import time

    from tiersync.net.config import TcpConfig
    from tiersync.net.tcp import TcpTransport
    from tiersync.weights.ops import WEIGHTS, Register

    io_s = 2.0
    g = {f"layer.{i}.weight": np.zeros(1, np.float32) for i in range(30_000)}  # ANNOUNCEs of about 3 MB
    config = PublisherConfig(shm=False, io_timeout_s=io_s, publish_timeout_s=0.2)
    pub = WeightPublisher(g, fsdp(1), config=config)
    stuck = [TcpTransport(TcpConfig(rcvbuf=4096), WEIGHTS).connect(pub.address) for _ in range(4)]
    try:
        for k, ch in enumerate(stuck):
            ch.request(Register(ch.new_request_id(), f"stuck-{k}", 0, "elsewhere", TransportKind.TCP), timeout=10)
        pub.wait_for_samplers(4, 10)
        for version in range(1, 40):  # until the buffers are full (their size is the kernel's)
            t0 = time.monotonic()
            result = pub.publish(version).result(120)
            took = time.monotonic() - t0
            if any(o.status is SyncStatus.DISCONNECTED for o in result.outcomes):
                break
        assert [o.status for o in result.outcomes] == [SyncStatus.DISCONNECTED] * 4
        assert io_s <= took < 3.5 * io_s  # one after the other: >= 4 * io_s (CI once took 2.5 * io_s at once)
        assert pub.samplers() == {}
    finally:
        for ch in stuck:
            ch.close()
        pub.close()
