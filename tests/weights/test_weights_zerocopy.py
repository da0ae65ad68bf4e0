"""Zero-copy samplers: leases read the trainer's segment in place, and a segment that a
sampler still reads is never rewritten (the trainer writes the next version elsewhere)."""

from __future__ import annotations

import os
import time

import pytest

from _sync_helpers import assert_bitwise, fsdp, model, shards_of
from tiersync.errors import UsageError
from tiersync.weights import Mesh, Sharding
from tiersync.weights.config import PublisherConfig, ReceiverConfig
from tiersync.weights.publisher import WeightPublisher
from tiersync.weights.receiver import WeightReceiver

TIMEOUT = 60


def _setup(g, shards=1, samplers=2, **cfg):
    shapes = {k: a.shape for k, a in g.items()}
    pubs = [
        WeightPublisher(
            shards_of(g, fsdp(shards), r),
            fsdp(shards),
            rank=r,
            global_shapes=shapes,
            config=PublisherConfig(segment_bytes=256),
        )
        for r in range(shards)
    ]
    dest = Sharding.replicated(Mesh((samplers,), ("dp",)))
    recs = [
        WeightReceiver(dest, ReceiverConfig(tuple(p.address for p in pubs), rank=r, zero_copy=True, **cfg))
        for r in range(samplers)
    ]
    for p in pubs:
        p.wait_for_samplers(samplers, TIMEOUT)
    return pubs, recs, dest


def _publish(pubs, g, version):
    for _p in pubs:
        for a in g.values():
            a.reshape(-1)[0] = version  # the publisher's shards are copies: refresh them
    futures = [p.publish(version, shards_of(g, fsdp(len(pubs)), r)) for r, p in enumerate(pubs)]
    for f in futures:
        res = f.result(TIMEOUT)
        assert res.ok, res.failed


def _segments(pub) -> set[str]:
    prefix = os.path.basename(pub.segment_path).rsplit("-", 1)[0]
    return {f for f in os.listdir(os.path.dirname(pub.segment_path)) if f.startswith(prefix)}


def _wait_held(pub, n):
    """Wait (on the publisher's condition) until ``n`` of its segments are held by samplers."""
    with pub._cond:
        assert pub._cond.wait_for(lambda: pub._pool.held() == n, TIMEOUT), pub._pool.held()


def test_lease_reads_the_segment_and_a_held_segment_is_not_rewritten():
    g = model(3)
    pubs, recs, dest = _setup(g)
    try:
        _publish(pubs, g, 1)
        leases = [r.receive(1).result(TIMEOUT) and r.acquire(TIMEOUT) for r in recs]
        for rank, lease in enumerate(leases):
            assert lease.version == 1
            assert_bitwise(lease.tensors, g, dest, rank)
            assert all(not a.flags.writeable and not a.flags.owndata for a in lease.tensors.values())
        old = {n: a.copy() for n, a in g.items()}
        _publish(pubs, g, 2)  # version 1 is leased: it goes to a second segment
        assert len(_segments(pubs[0])) == 2
        for rank, (rec, lease) in enumerate(zip(recs, leases)):
            assert_bitwise(lease.tensors, old, dest, rank)  # the leased version did not move
            with rec.acquire(TIMEOUT) as new:
                assert new.version == 2
                assert_bitwise(new.tensors, g, dest, rank)
            lease.release()
        _wait_held(pubs[0], 1)  # the RELEASEs of version 1 reached the trainer (only 2 is held now)
        for v in (3, 4, 5):  # released: the two segments alternate, no third one
            _publish(pubs, g, v)
            for rank, rec in enumerate(recs):
                with rec.acquire(TIMEOUT) as lease:
                    assert lease.version == v
                    assert_bitwise(lease.tensors, g, dest, rank)
        assert len(_segments(pubs[0])) == 2
        assert all(r.stats()["shm"] > 0 and r.stats()["tcp"] == 0 for r in recs)
    finally:
        for x in (*recs, *pubs):
            x.close()


@pytest.mark.parametrize("buffers", [1, 2])
def test_single_and_double_buffered_zero_copy_follow_every_version(buffers):
    g = model(4)
    pubs, recs, dest = _setup(g, samplers=1, buffers=buffers)
    try:
        for v in range(1, 6):
            _publish(pubs, g, v)
            with recs[0].acquire(TIMEOUT) as lease:
                assert lease.version == v
                assert_bitwise(lease.tensors, g, dest, 0)
        assert len(_segments(pubs[0])) <= 2
    finally:
        for x in (*recs, *pubs):
            x.close()


def test_two_trainer_shards_fall_back_to_copies():
    """A replicated sampler's tensor spans both shards' segments: it is copied, still exact."""
    g = model(5)
    pubs, recs, dest = _setup(g, shards=2)
    try:
        for v in (1, 2, 3):
            _publish(pubs, g, v)
            for rank, rec in enumerate(recs):
                with rec.acquire(TIMEOUT) as lease:
                    assert lease.version == v
                    assert_bitwise(lease.tensors, g, dest, rank)
                    assert all(a.flags.owndata or a.base is not None for a in lease.tensors.values())
        assert all(len(_segments(p)) == 1 for p in pubs)  # copies hold nothing: one segment each
    finally:
        for x in (*recs, *pubs):
            x.close()


def test_a_zero_copy_sampler_that_goes_away_retires_its_segment():
    g = model(6)
    pubs, recs, dest = _setup(g, samplers=1)
    try:
        _publish(pubs, g, 1)
        lease = recs[0].acquire(TIMEOUT)
        first = pubs[0].segment_path
        recs[0].close()  # disconnects while still leasing version 1
        deadline = time.monotonic() + TIMEOUT
        while pubs[0].samplers() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert os.path.exists(first)  # retired, but still the current version's: others may open it
        g1 = {name: a.copy() for name, a in g.items()}
        _publish(pubs, g, 2)
        assert not os.path.exists(first) and pubs[0].segment_path != first  # never rewritten
        assert_bitwise(lease.tensors, g1, dest, 0)  # the gone sampler's mapping still holds version 1
        lease.release()
    finally:
        for x in (*recs, *pubs):
            x.close()


def test_a_zero_copy_sync_that_fails_before_it_lands_releases_the_trainers_segment():
    """Version 2 fails at once (the one buffer set is leased past ``lease_timeout_s``): the
    sampler tells the trainer it holds nothing of it, so once version 3 is active only version
    3's segment is held (before: version 2's stayed held until the sampler left, and every
    later version took another segment of /dev/shm)."""
    g = model(3)
    pubs, recs, _ = _setup(g, samplers=1, buffers=1, lease_timeout_s=0.5)
    try:
        _publish(pubs, g, 1)
        lease = recs[0].acquire(TIMEOUT)
        res = pubs[0].publish(2, shards_of(g, fsdp(1), 0)).result(TIMEOUT)
        assert not res.ok  # the sampler could not begin writing: its only set is leased
        lease.release()
        _publish(pubs, g, 3)
        recs[0].receive(3).result(TIMEOUT)
        _wait_held(pubs[0], 1)
    finally:
        for x in (*recs, *pubs):
            x.close()


def test_zero_copy_is_validated():
    with pytest.raises(UsageError) as exc:
        ReceiverConfig(("h:1",), zero_copy=1)
    assert exc.value.argument == "zero_copy"
