"""TcpPool's pipelined GETs (tiersync.weights.fetch) against a real span server on loopback."""

from __future__ import annotations

import contextlib
import socket
import threading

import numpy as np
import pytest

from tiersync.errors import RemoteError, TierSyncError
from tiersync.net.config import TcpConfig
from tiersync.net.errors import NetTimeoutError
from tiersync.net.socket_io import Deadline
from tiersync.net.tcp import TcpTransport
from tiersync.weights import job_runner
from tiersync.weights.config import TransportKind
from tiersync.weights.fetch import Job, Source, TcpPool
from tiersync.weights.job_runner import JobRunner, _relay_feeds, _split
from tiersync.weights.ops import WEIGHTS
from tiersync.weights.relay_chunks import RelayChunks
from tiersync.weights.serving import SpanService
from tiersync.weights.spans import StridedSpan

TOKEN = b"k" * 32
SHARD = np.random.default_rng(7).integers(0, 256, 1 << 20, dtype=np.uint8)  # what the server holds
RESUME = threading.Event()  # a GET of tensor "stall" is answered once this is set


def _provider(version: int, tensor: str, key: tuple, span: object):
    if tensor == "stall":  # a trainer that stops answering, its socket open
        RESUME.wait(30)
    if tensor == "missing":
        raise TierSyncError("no such tensor", tensor=tensor)
    return SHARD, lambda: None


@pytest.fixture
def server():
    srv = TcpTransport(TcpConfig(token=TOKEN), WEIGHTS).serve("127.0.0.1:0", SpanService(_provider, 5.0))
    yield srv.address
    srv.close()


def _job(i: int, address: str, src: StridedSpan, dst: StridedSpan, tensor: str = "w") -> Job:
    return Job(tensor, i, (i,), 0, dst, (Source(TransportKind.TCP, src, address=address),))


def _jobs(address: str) -> list[Job]:
    """Contiguous chunks, a span of a few rows (landed row by row) and one of many rows
    (staged, then copied), all into one destination array."""
    jobs = [_job(i, address, StridedSpan(i * 65536, 65536), StridedSpan(i * 65536, 65536)) for i in range(8)]
    few = StridedSpan(600_000, 1000, (4,), (3000,))
    many = StridedSpan(700_000, 64, (300,), (128,))
    jobs.append(_job(8, address, few, StridedSpan(524_288, 1000, (4,), (1000,))))
    jobs.append(_job(9, address, many, StridedSpan(530_000, 64, (300,), (128,))))
    return jobs


def _expected(jobs: list[Job]) -> np.ndarray:
    want = np.zeros(1 << 20, np.uint8)
    for job in jobs:
        src = np.concatenate([SHARD[o : o + n] for o, n in job.sources[0].span.rows()])
        want[np.concatenate([np.arange(o, o + n) for o, n in job.dst_span.rows()])] = src
    return want


@pytest.mark.parametrize("window", [1, 3, 16])
def test_pipelined_gets_land_byte_exact_in_order(server, window):
    pool = TcpPool(2, TcpConfig(token=TOKEN), 5.0)
    jobs, dst, landed = _jobs(server), np.zeros(1 << 20, np.uint8), []
    try:
        pool.get_many(server, 1, jobs, {"w": dst}, window, landed.append, 10.0)
        assert landed == jobs  # each reported once its bytes are in place, in order
        assert np.array_equal(dst, _expected(jobs))
        pool.get_many(server, 2, jobs[:1], {"w": dst}, window, landed.append, 10.0)  # the channel was kept
        assert len(landed) == len(jobs) + 1
    finally:
        pool.close()


def test_an_idle_channel_to_a_restarted_sender_is_replaced_not_used():
    """The sender restarted on the same port while the pool's channel sat idle: the next batch
    opens a new channel instead of failing on the one the old sender hung up."""

    def serve(at: str):
        return TcpTransport(TcpConfig(token=TOKEN), WEIGHTS).serve(at, SpanService(_provider, 5.0))

    srv = serve("127.0.0.1:0")
    address, pool, dst = srv.address, TcpPool(1, TcpConfig(token=TOKEN), 5.0), np.zeros(1 << 20, np.uint8)
    jobs, landed = _jobs(srv.address), []
    try:
        pool.get_many(address, 1, jobs, {"w": dst}, 4, landed.append, 10.0)
        srv.close()
        srv = serve(address)
        dst[:] = 0
        pool.get_many(address, 2, jobs, {"w": dst}, 4, landed.append, 10.0)
        assert landed == jobs + jobs and np.array_equal(dst, _expected(jobs))
    finally:
        pool.close()
        srv.close()


@pytest.mark.parametrize("at", [0, 3, 4])
def test_a_refused_get_fails_the_batch_and_nothing_after_it_lands(server, at):
    pool = TcpPool(1, TcpConfig(token=TOKEN), 5.0)
    jobs = _jobs(server)[:7]
    bad = _job(99, server, StridedSpan(0, 64), StridedSpan(0, 64), tensor="missing")
    batch = [*jobs[:at], bad, *jobs[at:]]
    dst, landed = np.zeros(1 << 20, np.uint8), []
    try:
        with pytest.raises(RemoteError, match="GET refused: no such tensor"):
            pool.get_many(server, 1, batch, {"w": dst, "missing": np.zeros(64, np.uint8)}, 4, landed.append, 10.0)
        assert landed == jobs[: len(landed)] and len(landed) <= at  # a prefix of what came before it
        assert np.array_equal(dst[: 65536 * len(landed)], _expected(landed)[: 65536 * len(landed)])
        pool.get_many(server, 1, jobs[:1], {"w": dst}, 4, landed.append, 10.0)  # a fresh channel works
        assert landed[-1] == jobs[0]
    finally:
        pool.close()


def test_a_sender_that_stops_answering_fails_the_batch_after_io_timeout(server):
    pool = TcpPool(1, TcpConfig(token=TOKEN), 0.5)  # io_timeout_s; the batch itself has 60 s
    jobs = _jobs(server)[:3]
    stalled = _job(98, server, StridedSpan(0, 64), StridedSpan(0, 64), tensor="stall")
    dst, landed = np.zeros(1 << 20, np.uint8), []
    RESUME.clear()
    try:
        with pytest.raises(NetTimeoutError) as info:
            pool.get_many(
                server, 1, [*jobs, stalled, *jobs], {"w": dst, "stall": np.zeros(64, np.uint8)}, 4, landed.append, 60.0
            )
        assert info.value.context["timeout_s"] == 0.5 and info.value.peer == server
        # a prefix of what was answered before the stall (its last answers may have been taken
        # in the receive that timed out), nothing after it
        assert landed and landed == jobs[: len(landed)]
        n = 65536 * len(landed)
        assert np.array_equal(dst[:n], _expected(landed)[:n])
    finally:
        RESUME.set()
        pool.close()


def test_a_get_waits_its_whole_timeout_for_a_stream_others_hold_not_only_io_timeout(server):
    """A fallback GET to a trainer shard whose streams the pipelines hold waits for one to come
    back until the sync's deadline, not only ``io_timeout_s`` (each step of the GET itself still
    has that bound): a relay dying during a slow publish no longer fails the sync."""
    pool = TcpPool(1, TcpConfig(token=TOKEN), 0.5)  # one stream, io_timeout_s 0.5
    job, dst, done, errors = _jobs(server)[0], np.zeros(1 << 20, np.uint8), threading.Event(), []
    release, held = threading.Event(), threading.Event()

    def hold() -> None:
        with pool._pool.acquire(server, 5):  # the stream a pipeline holds
            held.set()
            release.wait(30)

    def fallback() -> None:
        try:
            pool.get(server, 1, job, job.sources[0], dst, timeout=30)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        done.set()

    holder, getter = threading.Thread(target=hold), threading.Thread(target=fallback)
    holder.start()
    assert held.wait(10)
    getter.start()
    try:
        assert not done.wait(1.5), errors  # three times io_timeout_s: still waiting, not failed
        release.set()
        assert done.wait(30) and not errors
        assert np.array_equal(dst[:65536], SHARD[:65536])
    finally:
        release.set()
        holder.join(10)
        getter.join(10)
        pool.close()


def test_a_peer_without_the_token_is_refused(server):
    pool = TcpPool(1, TcpConfig(token=b"x" * 32), 5.0)
    try:
        with pytest.raises(RemoteError):
            pool.get_many(server, 1, _jobs(server)[:2], {"w": np.zeros(1 << 20, np.uint8)}, 4, lambda j: None, 5.0)
    finally:
        pool.close()


def test_jobs_split_into_streams_per_sender_keeping_one_for_fallbacks():
    span = StridedSpan(0, 64)
    trainer, other = [_job(i, "t:1", span, span) for i in range(7)], [_job(i, "u:1", span, span) for i in range(2)]
    shm = Job("w", 9, (9,), 0, span, (Source(TransportKind.SHM, span, rank=0),))
    relayed = Job("w", 8, (8,), 0, span, (Source(TransportKind.TCP, span, address="r:1"), *trainer[0].sources))
    feeds, rest = _split([shm, *trainer, relayed, *other], 3)
    # t:1 is a relayed job's fallback: 2 of its 3 streams pipeline; u:1 has 2 jobs: 2 streams
    assert [a for a, _ in feeds] == ["t:1", "t:1", "u:1", "u:1"] and rest == [shm, relayed]
    assert feeds[0][1] is feeds[1][1] and list(feeds[0][1]) == trainer  # one feed per sender, in order
    assert next(feeds[2][1]) == other[0] and next(feeds[3][1]) == other[1]  # streams take turns
    feeds, rest = _split([shm, *trainer, relayed, *other], 1)
    assert [a for a, _ in feeds] == ["u:1"] and rest == [shm, *trainer, relayed]  # one stream: kept free


def test_relayed_jobs_are_fed_in_order_to_at_most_streams_workers_per_relay():
    span = StridedSpan(0, 64)
    fallback = _job(0, "t:1", span, span).sources

    def relayed(i: int, relay: str) -> Job:
        return Job("w", i, (i,), 0, span, (Source(TransportKind.TCP, span, address=relay), *fallback))

    by_r, by_q = [relayed(i, "r:1") for i in range(5)], [relayed(10 + i, "q:1") for i in range(2)]
    shm = Job("w", 9, (9,), 0, span, (Source(TransportKind.SHM, span, rank=0),))
    direct = _job(7, "t:1", span, span)
    mixed = [by_r[0], shm, by_q[0], by_r[1], direct, *by_r[2:], by_q[1]]
    feeds, rest = _relay_feeds(mixed, 3)
    assert rest == [shm, direct]  # neither relayed: left for the others, in order
    # r:1 gets 3 workers sharing one feed, q:1 only as many as it has jobs (2)
    assert len(feeds) == 5 and feeds[0] is feeds[1] is feeds[2] and feeds[3] is feeds[4]
    # each next job goes to whichever worker asks: in the relay's order, never two at once
    assert [next(feeds[2]), next(feeds[0]), next(feeds[1])] == by_r[:3] and list(feeds[0]) == by_r[3:]
    assert list(feeds[4]) == by_q
    assert _relay_feeds([shm, direct], 3) == ([], [shm, direct])


def _runner(streams: int, bufs: dict, progress=None) -> tuple[JobRunner, TcpPool]:
    relay = RelayChunks()
    relay.begin(1, bufs)
    pool = TcpPool(streams, TcpConfig(token=TOKEN), 5.0)
    return JobRunner(None, pool, relay, progress, 1, streams, 2), pool  # no shared-memory jobs: no links


def test_a_runner_lands_pipelined_and_relayed_jobs_with_a_dead_relay_falling_back(server):
    dead = socket.create_server(("127.0.0.1", 0))
    relay = f"127.0.0.1:{dead.getsockname()[1]}"
    dead.close()  # nothing listens there: the relayed job falls back to the trainer's kept stream
    jobs = _jobs(server)
    relayed = Job(
        "w",
        7,
        (7,),
        0,
        jobs[7].dst_span,
        (Source(TransportKind.TCP, jobs[7].sources[0].span, address=relay), *jobs[7].sources),
    )
    jobs[7] = relayed
    seen = []
    dst = np.zeros(1 << 20, np.uint8)
    runner, pool = _runner(2, {"w": dst}, lambda v, done, total: seen.append((v, done, total)))
    try:
        runner.run(1, jobs, [], {"w": dst}, Deadline(30.0, "sync"))
        assert np.array_equal(dst, _expected(jobs))
        total = sum(j.nbytes for j in jobs)
        assert runner.stats()["tcp"] == total and seen[-1] == (1, total, total) and len(seen) == len(jobs)
    finally:
        pool.close()


def test_a_relay_that_hangs_costs_one_timeout_per_run_not_one_per_chunk(server):
    """A relay that takes connections and never answers (its listener never accepts): the first
    of its chunks falls back to the trainer after io_timeout_s, the others at once, without
    trying that relay again (one connection reached it; three, one timeout each, before)."""
    silent = socket.create_server(("127.0.0.1", 0))  # the kernel completes connects; nothing answers
    relay = f"127.0.0.1:{silent.getsockname()[1]}"
    jobs = _jobs(server)
    for i in (5, 6, 7):
        via_relay = Source(TransportKind.TCP, jobs[i].sources[0].span, address=relay)
        jobs[i] = Job("w", i, (i,), 0, jobs[i].dst_span, (via_relay, *jobs[i].sources))
    dst = np.zeros(1 << 20, np.uint8)
    runner, pool = _runner(1, {"w": dst})  # one stream: the relayed chunks one after the other
    try:
        runner.run(1, jobs, [], {"w": dst}, Deadline(60.0, "sync"))
        assert np.array_equal(dst, _expected(jobs))
        silent.setblocking(False)
        tried = 0
        with contextlib.suppress(BlockingIOError):
            while True:
                silent.accept()[0].close()
                tried += 1
        assert tried == 1
    finally:
        pool.close()
        silent.close()


def test_a_runner_fails_the_version_when_a_pipelined_get_is_refused(server):
    jobs = _jobs(server) + [_job(99, server, StridedSpan(0, 64), StridedSpan(0, 64), tensor="missing")]
    bufs = {"w": np.zeros(1 << 20, np.uint8), "missing": np.zeros(64, np.uint8)}
    runner, pool = _runner(2, bufs)
    try:
        with pytest.raises(RemoteError, match="GET refused"):
            runner.run(1, jobs, [], bufs, Deadline(30.0, "sync"))
        assert runner.stats()["tcp"] < sum(j.nbytes for j in jobs)
    finally:
        pool.close()


def test_a_pipelined_stream_stops_at_its_next_answer_once_another_job_failed(server, monkeypatch):
    # Two streams, one GET in flight each: one blocks on the stalled chunk, the other is refused.
    # The refusal is recorded, then the stall answered: that stream lands it and asks for nothing more.
    recorded = job_runner._Tally.failed

    def failed(self, exc):
        recorded(self, exc)
        RESUME.set()

    monkeypatch.setattr(job_runner._Tally, "failed", failed)
    stalled = _job(97, server, StridedSpan(0, 64), StridedSpan(0, 64), tensor="stall")
    refused = _job(99, server, StridedSpan(0, 64), StridedSpan(0, 64), tensor="missing")
    later = _jobs(server)[:4]
    bufs = {"w": np.zeros(1 << 20, np.uint8), "stall": np.zeros(64, np.uint8), "missing": np.zeros(64, np.uint8)}
    relay = RelayChunks()
    relay.begin(1, bufs)
    pool = TcpPool(2, TcpConfig(token=TOKEN), 5.0)
    runner = JobRunner(None, pool, relay, None, 1, 2, 1)  # window 1
    RESUME.clear()
    try:
        with pytest.raises(RemoteError, match="GET refused"):
            runner.run(1, [stalled, refused, *later], [], bufs, Deadline(30.0, "sync"))
        assert RESUME.is_set() and runner.stats()["tcp"] == 64  # the stalled chunk landed, nothing after it
        assert np.array_equal(bufs["stall"], SHARD[:64]) and not bufs["w"].any()
    finally:
        RESUME.set()
        pool.close()
