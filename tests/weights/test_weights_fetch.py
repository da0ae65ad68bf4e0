"""TcpPool's pipelined GETs (tiersync.weights.fetch) against a real span server on loopback."""

from __future__ import annotations

import numpy as np
import pytest

from tiersync.errors import RemoteError, TierSyncError
from tiersync.net.config import TcpConfig
from tiersync.net.tcp import TcpTransport
from tiersync.weights.config import TransportKind
from tiersync.weights.fetch import Job, Source, TcpPool
from tiersync.weights.ops import WEIGHTS
from tiersync.weights.serving import SpanService
from tiersync.weights.spans import StridedSpan

TOKEN = b"k" * 32
SHARD = np.random.default_rng(7).integers(0, 256, 1 << 20, dtype=np.uint8)  # what the server holds


def _provider(version: int, tensor: str, key: tuple, timeout_s: float):
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


def test_a_refused_get_fails_the_batch_after_the_chunks_before_it(server):
    pool = TcpPool(1, TcpConfig(token=TOKEN), 5.0)
    jobs = _jobs(server)[:4]
    bad = _job(4, server, StridedSpan(0, 64), StridedSpan(0, 64), tensor="missing")
    dst, landed = np.zeros(1 << 20, np.uint8), []
    try:
        with pytest.raises(RemoteError, match="GET refused: no such tensor"):
            pool.get_many(
                server,
                1,
                [*jobs, bad, *_jobs(server)[4:6]],
                {"w": dst, "missing": np.zeros(64, np.uint8)},
                4,
                landed.append,
                10.0,
            )
        assert landed == jobs  # what came before the refusal landed; nothing after it
        assert np.array_equal(dst, _expected(jobs))
        pool.get_many(server, 1, jobs[:1], {"w": dst}, 4, landed.append, 10.0)  # a fresh channel works
        assert len(landed) == len(jobs) + 1
    finally:
        pool.close()


def test_a_peer_without_the_token_is_refused(server):
    pool = TcpPool(1, TcpConfig(token=b"x" * 32), 5.0)
    try:
        with pytest.raises(RemoteError):
            pool.get_many(server, 1, _jobs(server)[:2], {"w": np.zeros(1 << 20, np.uint8)}, 4, lambda j: None, 5.0)
    finally:
        pool.close()


def test_jobs_split_into_pipelined_parts_per_sender_keeping_a_stream_for_fallbacks():
    from tiersync.weights.job_runner import _split

    span = StridedSpan(0, 64)
    trainer, other = [_job(i, "t:1", span, span) for i in range(7)], [_job(i, "u:1", span, span) for i in range(3)]
    shm = Job("w", 9, (9,), 0, span, (Source(TransportKind.SHM, span, rank=0),))
    relayed = Job("w", 8, (8,), 0, span, (Source(TransportKind.TCP, span, address="r:1"), *trainer[0].sources))
    parts, rest = _split([shm, *trainer, relayed, *other], 3)
    # t:1 is a relayed job's fallback: 2 of its 3 streams pipeline, one stays free; u:1 uses 3
    assert parts == [trainer[0::2], trainer[1::2], other[0:1], other[1:2], other[2:3]]
    assert rest == [shm, relayed]  # in their order
    parts, rest = _split([shm, *trainer, relayed, *other], 1)
    assert parts == [other] and rest == [shm, *trainer, relayed]  # one stream: kept for the fallback
