"""Delta weight updates: a publisher in this process, samplers in child processes
(``_delta_child.py``), real sockets and a real /dev/shm segment. Each version moves only the
chunks whose bytes differ from what each sampler actually holds, and lands byte-exact."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest

from _lines import LineChild
from _sync_helpers import digests, fsdp
from tiersync.errors import IntegrityError, UsageError
from tiersync.net.frames import SUPPORTED
from tiersync.weights import Mesh, Sharding
from tiersync.weights.config import PublisherConfig, ReceiverConfig, SyncStatus, TransportKind
from tiersync.weights.delta import chunk_sum, land_delta
from tiersync.weights.fetch import Job, Source
from tiersync.weights.publisher import WeightPublisher
from tiersync.weights.receiver import WeightReceiver
from tiersync.weights.spans import StridedSpan

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT = 60
ROW = 1024  # bytes per row of "w" = one chunk (segment_bytes)
ROWS = 300


class _Child(LineChild):
    """A delta sampler process; its stdout lines arrive on a queue, commands go to its stdin."""

    def __init__(self, address: str, rank: int, transport: str, buffers: int) -> None:
        super().__init__("_delta_child.py", [address, str(rank), "3", transport, str(buffers)], TIMEOUT, stdin=True)

    def command(self, line: str, answer: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        self.expect(answer)

    def version(self, v: int) -> tuple[int, int, int, dict[str, int]]:
        """(moved, copied, nbytes, digests) of version ``v``; fails on ``FAILED v`` or a later version."""
        line = self.expect("VERSION")
        _, got, moved, copied, nbytes, blob = line.split(" ", 5)
        assert int(got) == v, line
        return int(moved), int(copied), int(nbytes), {k: int(x) for k, x in json.loads(blob).items()}

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(TIMEOUT)


def _model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "w": rng.standard_normal((ROWS, ROW // 4)).astype(np.float32),  # 300 chunks of one row
        "b": rng.standard_normal((2, ROW // 4)).astype(np.float32),
    }  # 2 more, never changed


def _change(g: dict[str, np.ndarray], rows: list[int]) -> None:
    g["w"][rows] += 1.0  # training updated these rows in place


def _check(child: _Child, v: int, g, moved: int, copied: int | None = None) -> None:
    got_moved, got_copied, nbytes, got = child.version(v)
    assert got == digests(g), f"version {v} is not byte-exact"
    assert nbytes == sum(a.nbytes for a in g.values())
    assert got_moved == moved, (v, got_moved, moved)
    if copied is not None:
        assert got_copied == copied, (v, got_copied, copied)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_delta_moves_changed_chunks_catches_up_and_refetches_damage(transport):
    g = _model()
    total = sum(a.nbytes for a in g.values())
    cfg = PublisherConfig(shm=transport == "shm", segment_bytes=ROW, publish_timeout_s=3)
    pub = WeightPublisher(g, fsdp(1), config=cfg)
    # rank 0: double-buffered; rank 1: one buffer; rank 2: double-buffered, misses versions 2 and 3
    children = [_Child(pub.address, r, transport, 1 if r == 1 else 2) for r in range(3)]
    try:
        for c in children:
            c.expect("READY")
        pub.wait_for_samplers(3, TIMEOUT)
        res = pub.publish(1).result(TIMEOUT)
        assert res.ok and res.moved == 3 * total  # nothing held: everything moves
        for c in children:
            _check(c, 1, g, total, 0)

        children[2].command("STALL 2", "ARMED")
        _change(g, [5, 100, 250])  # 3 of 302 chunks: 1%
        res = pub.publish(2).result(TIMEOUT)
        by_rank = {o.rank: o for o in res.outcomes}
        assert by_rank[2].status is SyncStatus.TIMEOUT  # stalled mid-sync
        assert by_rank[0].moved == by_rank[1].moved == 3 * ROW
        _check(children[0], 2, g, 3 * ROW, total - 3 * ROW)  # the rest copied from the active set
        _check(children[1], 2, g, 3 * ROW, 0)  # one buffer: the rest stays in place

        res = pub.publish(3).result(TIMEOUT)  # no change: only metadata moves
        assert res.moved == 0 and [o.rank for o in res.failed] == [2]
        _check(children[0], 3, g, 0, 3 * ROW)  # the standby set held v1: only v2's rows are copied
        _check(children[1], 3, g, 0, 0)

        _change(g, [6, 7, 299])
        fut = pub.publish(4)
        _check(children[0], 4, g, 3 * ROW)
        _check(children[1], 4, g, 3 * ROW, 0)
        children[2].command("GO", "GONE")  # v2 resumes against a trainer now at v4: it fails
        assert children[2].expect("FAILED") == "FAILED 2"
        assert children[2].expect("FAILED") == "FAILED 3"
        _check(children[2], 4, g, 6 * ROW, total - 6 * ROW)  # holds v1: the union of v2's and v4's rows
        fut.result(TIMEOUT)

        for c in children[:2]:  # damage row 40 of "w" in every buffer set of ranks 0 and 1
            c.command(f"DAMAGE {g['w'].nbytes} {40 * ROW + 3}", "DAMAGED")
        res = pub.publish(5).result(TIMEOUT)
        assert res.ok, res
        _check(children[0], 5, g, ROW)  # the damaged chunk is refetched, never served
        _check(children[1], 5, g, ROW)
        _check(children[2], 5, g, 0)
    finally:
        for c in children:
            c.kill()
        pub.close()


def _in_process(g, count, fanout, segment=ROW, **rcfg):
    pub = WeightPublisher(g, fsdp(1), config=PublisherConfig(shm=False, segment_bytes=segment, fanout=fanout))
    layout = Sharding.replicated(Mesh((count,), ("dp",)))
    recs = [WeightReceiver(layout, ReceiverConfig((pub.address,), rank=r, **rcfg)) for r in range(count)]
    pub.wait_for_samplers(count, TIMEOUT)
    return pub, recs


def test_delta_through_relays_is_byte_exact():
    """fanout=1: most chunks reach a sampler through another one's buffer (kept or copied there).
    Chunks of 32 rows: rows 1-3 are one chunk, rows 40 and 299 one each."""
    g = _model()
    pub, recs = _in_process(g, 4, 1, 32 * ROW, transport=TransportKind.TCP)
    try:
        assert pub.publish(1).result(TIMEOUT).ok
        _change(g, [1, 2, 3, 40, 299])
        res = pub.publish(2).result(TIMEOUT)
        moved = 32 * ROW + 32 * ROW + (ROWS - 288) * ROW  # the last chunk of "w" has 12 rows
        assert res.ok and res.moved == 4 * moved, res
        for r in recs:
            assert r.receive(2).result(TIMEOUT).moved == moved
            with r.acquire(TIMEOUT) as lease:
                assert digests(lease.tensors) == digests(g)
        assert sum(r.stats()["relay"] for r in recs) > 0  # relays did serve chunks
    finally:
        for x in (*recs, pub):
            x.close()


def test_a_lying_relay_is_caught_by_the_trainers_checksums_with_delta_off(monkeypatch):
    """Relays that serve altered bytes under a checksum of their own (the frame verifies): each
    sampler checks relayed chunks against the trainer's checksums too, refetches those from the
    trainer and commits the trainer's bytes. Before, delta off committed what relays sent."""
    from tiersync.weights.relay_chunks import RelayChunks

    honest = RelayChunks.provide

    def lying(self, version, name, key, span):
        got = honest(self, version, name, key, span)
        if not isinstance(got, tuple):  # not landed yet: a watch
            return got
        arr, done = got
        bad = arr.copy()
        bad[:] ^= 0x5A  # the chunk's bytes are what the GET's span picks out of the tensor
        return bad, done

    monkeypatch.setattr(RelayChunks, "provide", lying)
    g = _model()
    total = sum(a.nbytes for a in g.values())
    pub, recs = _in_process(g, 3, 1, 32 * ROW, transport=TransportKind.TCP, delta=False)
    try:
        assert pub.publish(1).result(TIMEOUT).ok
        moved = [r.receive(1).result(TIMEOUT).moved for r in recs]
        for r in recs:
            with r.acquire(TIMEOUT) as lease:
                assert digests(lease.tensors) == digests(g)
        assert sum(r.stats()["relay"] for r in recs) > 0  # relays did serve (altered) chunks
        assert max(moved) > total, moved  # and those chunks were fetched again
    finally:
        for x in (*recs, pub):
            x.close()


def test_relays_serve_a_restarted_trainers_reused_version_numbers_without_stale_sums():
    """A trainer restarted on its address numbers its versions again, with other bytes. Each
    relay keyed the checksums it sums per trainer incarnation (its GETs name the one the
    manifest named): the new process's version 1 goes through the relays like the old one's,
    every chunk once, none refused for a stale sum and fetched again from the trainer."""
    g = _model()
    total = sum(a.nbytes for a in g.values())
    pub, recs = _in_process(g, 3, 1, 32 * ROW, transport=TransportKind.TCP, delta=False)
    try:
        assert pub.publish(1).result(TIMEOUT).ok
        assert [r.receive(1).result(TIMEOUT).moved for r in recs] == [total] * 3
        relayed = sum(r.stats()["relay"] for r in recs)
        address = pub.address
        pub.close()
        g = {k: -a for k, a in g.items()}  # the checkpoint the new process starts from
        config = PublisherConfig(shm=False, segment_bytes=32 * ROW, fanout=1, listen=address)
        pub = WeightPublisher(g, fsdp(1), config=config)
        pub.wait_for_samplers(3, TIMEOUT)  # they register again on their own
        assert pub.publish(1).result(TIMEOUT).ok
        assert [r.receive(1).result(TIMEOUT).moved for r in recs] == [total] * 3  # nothing fetched twice
        for r in recs:
            with r.acquire(TIMEOUT) as lease:
                assert lease.version == 1 and digests(lease.tensors) == digests(g)
        assert sum(r.stats()["relay"] for r in recs) > relayed  # the relays served the new version
    finally:
        for x in (*recs, pub):
            x.close()


def test_delta_off_moves_every_byte_and_is_validated():
    g = _model()
    total = sum(a.nbytes for a in g.values())
    pub, recs = _in_process(g, 2, 64, transport=TransportKind.TCP, delta=False)
    try:
        for v in (1, 2):  # version 2 changes nothing and still moves everything
            res = pub.publish(v).result(TIMEOUT)
            assert res.ok and res.moved == 2 * total, res
    finally:
        for x in (*recs, pub):
            x.close()
    with pytest.raises(UsageError) as err:
        ReceiverConfig(("h:1",), delta=1)
    assert err.value.argument == "delta"
    assert ReceiverConfig(("h:1",)).delta is True


def _jobs(n: int) -> list[Job]:
    return [
        Job(
            "w",
            0,
            (i * ROW,),
            0,
            StridedSpan(i * ROW, ROW, (), ()),
            (Source(TransportKind.TCP, StridedSpan(i * ROW, ROW, (), ()), address="127.0.0.1:1"),),
            0,
            StridedSpan(i * ROW, ROW, (), ()),
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("fixable", [True, False])
def test_land_delta_refetches_bad_local_chunks_and_never_keeps_wrong_bytes(fixable):
    """The landing step alone: chunk 1 is 'kept' (its checksum is what the set held) but its
    bytes were damaged; the direct refetch fixes it, or IntegrityError when even that is wrong."""
    algo = SUPPORTED[0]
    truth = np.random.default_rng(3).integers(0, 256, 4 * ROW, dtype=np.uint8)
    jobs = _jobs(4)
    want = {("w", j.key): chunk_sum(algo, truth, j.dst_span) for j in jobs}
    bufs = {"w": truth.copy()}
    bufs["w"][ROW + 5] ^= 0xFF
    fetched = []

    def fetch(js):
        fetched.extend(j.key for j in js)
        for j in js:
            bufs["w"][j.dst_span.offset : j.dst_span.offset + ROW] = truth[j.dst_span.offset : j.dst_span.offset + ROW]
            if not fixable:
                bufs["w"][j.dst_span.offset] ^= 1

    landed = []
    if fixable:
        out = land_delta(algo, want, jobs, bufs, dict(want), None, fetch, landed.extend)
        assert fetched == [(ROW,)] and out.refetched == 1 and out.moved == ROW and out.kept == 4 * ROW
        assert bufs["w"].tobytes() == truth.tobytes()
        assert sorted(j.key for j in landed) == [(0,), (2 * ROW,), (3 * ROW,)]  # relays may serve these
    else:
        with pytest.raises(IntegrityError):
            land_delta(algo, want, jobs, bufs, dict(want), None, fetch, landed.extend)
        assert (ROW,) not in [j.key for j in landed]
