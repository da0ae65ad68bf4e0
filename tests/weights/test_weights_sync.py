"""Trainer -> sampler weight sync end to end, publishers and receivers in this process over real
sockets and a real /dev/shm segment: every received shard is bitwise the source slice."""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest

from _sync_helpers import assert_bitwise, fsdp, model, shards_of, tp_dp_layout
from tiersync.errors import UsageError
from tiersync.store.keys import CacheIdentity
from tiersync.weights import Mesh, Sharding
from tiersync.weights.config import PublisherConfig, ReceiverConfig, SyncStatus, TransportKind
from tiersync.weights.publisher import WeightPublisher
from tiersync.weights.receiver import WeightReceiver

TIMEOUT = 60


def _publishers(g, n, **cfg):
    shapes = {k: a.shape for k, a in g.items()}
    return [
        WeightPublisher(shards_of(g, fsdp(n), r), fsdp(n), rank=r, global_shapes=shapes, config=PublisherConfig(**cfg))
        for r in range(n)
    ]


def _receivers(pubs, layout, count, **cfg):
    addrs = tuple(p.address for p in pubs)
    recs = [WeightReceiver(layout, ReceiverConfig(addrs, rank=r, **cfg)) for r in range(count)]
    for p in pubs:
        p.wait_for_samplers(count, TIMEOUT)
    return recs


def _publish(pubs, version):
    results = [f.result(TIMEOUT) for f in [p.publish(version) for p in pubs]]
    return results


def _close(*groups):
    for group in groups:
        for x in group:
            x.close()


@pytest.mark.parametrize("transport", [TransportKind.AUTO, TransportKind.SHM, TransportKind.TCP])
def test_two_trainer_shards_to_tp2_dp3_samplers_bitwise(transport):
    g = model()
    layout = tp_dp_layout(g)
    pubs = _publishers(g, 2, segment_bytes=300)
    recs = _receivers(pubs, layout, 6, transport=transport)
    try:
        want = TransportKind.TCP if transport is TransportKind.TCP else TransportKind.SHM
        assert all(r.transports() == (want, want) for r in recs)
        results = _publish(pubs, 1)
        assert all(res.ok and len(res.outcomes) == 6 for res in results), results
        assert {o.transport for res in results for o in res.outcomes} == {want}
        for rank, rec in enumerate(recs):
            assert rec.receive(1).result(TIMEOUT).version == 1
            with rec.acquire(TIMEOUT) as lease:
                assert lease.version == 1
                assert_bitwise(lease.tensors, g, layout, rank)
        route = "shm" if want is TransportKind.SHM else "tcp"
        assert all(r.stats()[route] > 0 and r.stats()["relay"] == 0 for r in recs)
    finally:
        _close(recs, pubs)


def test_large_spans_are_answered_with_sums_taken_while_the_version_was_written(monkeypatch):
    """Over TCP, a trainer shard's spans of at least one piece carry checksums composed from the
    sums its copy-in took (no second read of their bytes), and the receivers verify them."""
    from tiersync.weights import piece_sums, serving

    summed = []
    real = serving.sum_of
    monkeypatch.setattr(serving, "sum_of", lambda algo, parts: summed.append(sum(map(len, parts))) or real(algo, parts))
    rng = np.random.default_rng(4)
    g = {"big": rng.standard_normal((3 * piece_sums.PIECE // 4 + 33, 4)).astype(np.float32), **model()}
    # "big" (12 pieces + 528 bytes of 16-byte rows) in chunks of 2 pieces + 4096: each composed
    # from the whole pieces inside it and its head and tail summed alone; the last one ends on
    # the tensor's short last piece
    pubs = _publishers(g, 1, segment_bytes=2 * piece_sums.PIECE + 4096)
    replicas = {n: Sharding(Mesh((2,), ("dp",)), (None,) * a.ndim) for n, a in g.items()}
    recs = _receivers(pubs, replicas, 2, transport=TransportKind.TCP)
    try:
        for version in (1, 2):
            g["big"] += 1
            results = _publish(pubs, version)
            assert all(res.ok for res in results), results
            for rank, rec in enumerate(recs):
                rec.receive(version).result(TIMEOUT)
                with rec.acquire(TIMEOUT) as lease:
                    assert lease.version == version
                    assert_bitwise(lease.tensors, g, replicas, rank)
        assert summed == []  # every span's checksum was composed, none read again whole
    finally:
        _close(recs, pubs)


def test_large_fanout_relays_through_samplers_over_tcp():
    g = model(1)
    layout = Sharding.replicated(Mesh((4,), ("dp",)))
    pubs = _publishers(g, 1, fanout=1, segment_bytes=512)  # one push per chunk, the rest relayed
    recs = _receivers(pubs, layout, 4, transport=TransportKind.TCP)
    try:
        for version in (3, 4):
            for a in g.values():
                a.reshape(-1)[0] = a.reshape(-1)[0] + 1  # training changed the weights in place
            pubs[0]._tensors.update(shards_of(g, fsdp(1), 0))
            assert all(res.ok for res in _publish(pubs, version))
            for rank, rec in enumerate(recs):
                rec.receive(version).result(TIMEOUT)
                with rec.acquire(TIMEOUT) as lease:
                    assert lease.version == version
                    assert_bitwise(lease.tensors, g, layout, rank)
        assert sum(r.stats()["relay"] for r in recs) > 0  # samplers really relayed
    finally:
        _close(recs, pubs)


def test_relays_that_begin_a_version_after_their_readers_still_relay_every_chunk_planned():
    """Eight single-buffered samplers whose readers hold their weights a while into the next
    sync (leases released 0-140 ms apart): a relay begins the version only then, after samplers
    that read from it asked for its chunks. Those GETs wait for it, so every chunk the plan
    relays is relayed in every version (7 of 8 samplers' bytes with fanout 1); refused, the
    readers dropped the relay for the sync and took its chunks from the trainer (0.33-0.75)."""
    import threading

    rng = np.random.default_rng(6)
    g = {f"t{i}": rng.standard_normal((256, 1024)).astype(np.float32) for i in range(8)}
    layout = Sharding.replicated(Mesh((8,), ("dp",)))
    pubs = _publishers(g, 1, fanout=1, segment_bytes=256 << 10)
    recs = _receivers(pubs, layout, 8, transport=TransportKind.TCP, buffers=1, delta=False)  # every byte moves
    try:
        assert all(res.ok for res in _publish(pubs, 1))
        before = [r.stats() for r in recs]
        for version in (2, 3, 4):
            for i, r in enumerate(recs):
                lease = r.acquire(TIMEOUT)
                lease.__enter__()
                threading.Timer(0.02 * ((i * 5) % 8), lease.__exit__, (None, None, None)).start()
            assert all(res.ok for res in _publish(pubs, version))
            after = [r.stats() for r in recs]
            relayed = sum(a["relay"] - b["relay"] for a, b in zip(after, before))
            moved = sum(a["relay"] + a["tcp"] - b["relay"] - b["tcp"] for a, b in zip(after, before))
            assert moved == 8 * 8 * 1024 * 1024 and relayed * 8 == moved * 7, (version, relayed, moved)
            before = after
    finally:
        _close(recs, pubs)


def test_publish_rereads_tensors_updated_in_place_and_replacements():
    g = model(2)
    pubs = _publishers(g, 1)
    recs = _receivers(pubs, fsdp(1), 1)
    try:
        _publish(pubs, 1)
        local = pubs[0]._tensors
        local["embed"][...] = 7.0  # an in-place optimizer step
        assert _publish(pubs, 2)[0].ok
        with recs[0].acquire(TIMEOUT) as lease:
            assert lease.version == 2 and float(lease.tensors["embed"].min()) == 7.0
        new = {"head": np.full_like(g["head"], 3)}
        assert pubs[0].publish(5, new).result(TIMEOUT).ok
        recs[0].receive(5).result(TIMEOUT)
        with recs[0].acquire(TIMEOUT) as lease:
            assert lease.version == 5 and lease.tensors["head"].tobytes() == new["head"].tobytes()
    finally:
        _close(recs, pubs)


def test_version_feeds_the_kv_cache_identity():
    g = model(3)
    pubs = _publishers(g, 1)
    recs = _receivers(pubs, fsdp(1), 1)
    base = CacheIdentity("m", "0", "bf16", 16)
    try:
        _publish(pubs, 1)
        recs[0].receive(1).result(TIMEOUT)
        with recs[0].acquire(TIMEOUT) as lease:
            first = lease.identity(base)
        _publish(pubs, 2)
        recs[0].receive(2).result(TIMEOUT)
        with recs[0].acquire(TIMEOUT) as lease:
            second = lease.identity(base)
        assert first == replace(base, weights_version="1") and second.weights_version == "2"
        assert first.digest() != second.digest()  # KV saved under v1 is never found under v2
    finally:
        _close(recs, pubs)


def test_publish_refusals_leave_state_unchanged():
    g = model(4)
    pubs = _publishers(g, 1)
    recs = _receivers(pubs, fsdp(1), 1)
    try:
        _publish(pubs, 3)
        for call, argument in [
            (lambda: pubs[0].publish(3), "version"),
            (lambda: pubs[0].publish(-1), "version"),
            (lambda: pubs[0].publish(4, {"embed": np.zeros((2, 2), np.float32)}), "tensors"),
            (lambda: pubs[0].publish(4, {"nope": g["embed"]}), "tensors"),
        ]:
            with pytest.raises(UsageError) as exc:
                call()
            assert exc.value.argument == argument
        assert pubs[0].publish(4).result(TIMEOUT).ok  # 4 is still free: the refusals changed nothing
    finally:
        _close(recs, pubs)


def test_forced_shm_is_refused_without_a_segment():
    g = model(5)
    pubs = _publishers(g, 1, shm=False)
    try:
        with pytest.raises(UsageError) as exc:
            WeightReceiver(fsdp(1), ReceiverConfig((pubs[0].address,), transport=TransportKind.SHM))
        assert exc.value.argument == "transport"
        rec = WeightReceiver(fsdp(1), ReceiverConfig((pubs[0].address,)))  # AUTO falls back to TCP
        assert rec.transports() == (TransportKind.TCP,)
        rec.close()
    finally:
        _close(pubs)


def test_sampler_with_a_mismatched_layout_fails_alone():
    g = model(6)
    pubs = _publishers(g, 1)
    good = _receivers(pubs, fsdp(1), 1)
    bad = WeightReceiver({"embed": fsdp(1)}, ReceiverConfig((pubs[0].address,), rank=1))  # lacks tensors
    pubs[0].wait_for_samplers(2, TIMEOUT)
    try:
        res = _publish(pubs, 1)[0]
        by_rank = {o.rank: o for o in res.outcomes}
        assert by_rank[0].status is SyncStatus.OK
        assert by_rank[1].status is SyncStatus.FAILED and "destination" in by_rank[1].error
        with pytest.raises(UsageError):
            bad.receive(1).result(TIMEOUT)
    finally:
        _close([bad], good, pubs)


def test_segment_is_unlinked_on_close():
    pubs = _publishers(model(7), 1)
    path = pubs[0].segment_path
    assert path is not None and os.path.exists(path)
    pubs[0].close()
    assert not os.path.exists(path)


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"publishers": ()}, "publishers"),
        ({"publishers": ("nohost",)}, "publishers"),
        ({"publishers": ("h:1",), "buffers": 3}, "buffers"),
        ({"publishers": ("h:1",), "transport": "tcp"}, "transport"),
        ({"publishers": ("h:1",), "streams": 0}, "streams"),
        ({"publishers": ("h:1",), "window": 0}, "window"),
        ({"publishers": ("h:1",), "window": True}, "window"),
        ({"publishers": ("h:1",), "sync_timeout_s": 0}, "sync_timeout_s"),
        ({"publishers": ("h:1",), "rank": -1}, "rank"),
    ],
)
def test_receiver_config_is_validated(kwargs, argument):
    with pytest.raises(UsageError) as exc:
        ReceiverConfig(**kwargs)
    assert exc.value.argument == argument


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"listen": "x"}, "listen"),
        ({"fanout": 0}, "fanout"),
        ({"segment_bytes": -1}, "segment_bytes"),
        ({"publish_timeout_s": 0}, "publish_timeout_s"),
        ({"shm": 1}, "shm"),
    ],
)
def test_publisher_config_is_validated(kwargs, argument):
    with pytest.raises(UsageError) as exc:
        PublisherConfig(**kwargs)
    assert exc.value.argument == argument


def test_publisher_refuses_bad_tensors_and_layouts():
    g = model(8)
    with pytest.raises(UsageError) as exc:
        WeightPublisher({}, fsdp(1))
    assert exc.value.argument == "tensors"
    with pytest.raises(UsageError) as exc:
        WeightPublisher(g, {"embed": fsdp(1)})
    assert exc.value.argument == "layout"
    with pytest.raises(UsageError) as exc:  # rank 0 of 37 rows split 2 ways holds 18, not 19
        WeightPublisher({"embed": g["embed"][:19]}, fsdp(2), rank=0, global_shapes={"embed": (37, 24)})
    assert exc.value.argument == "global_shapes"


@pytest.mark.parametrize("transport", [TransportKind.SHM, TransportKind.TCP])
def test_the_workers_of_two_engines_share_ranks_and_all_get_every_version_bitwise(transport):
    """Two engines of the same layout (TP 2 x DP 3 each) fed by two trainer shards: each rank
    is held by a worker of each engine, under a label of its own (the default: unique even in
    one process). Every worker gets every version bitwise. Before, the registry kept one sampler per rank: the second engine's workers
    replaced the first's, which then got nothing."""
    g = model()
    layout = tp_dp_layout(g)
    pubs = _publishers(g, 2, segment_bytes=300)
    addrs = tuple(p.address for p in pubs)
    recs = [WeightReceiver(layout, ReceiverConfig(addrs, rank=r, transport=transport)) for _ in "ab" for r in range(6)]
    try:
        for p in pubs:
            p.wait_for_samplers(12, TIMEOUT)
        for version in (1, 2):
            results = _publish(pubs, version)
            assert all(res.ok and len(res.outcomes) == 12 for res in results), results
            for i, rec in enumerate(recs):
                assert rec.receive(version).result(TIMEOUT).version == version
                with rec.acquire(TIMEOUT) as lease:
                    assert_bitwise(lease.tensors, g, layout, i % 6)
        assert pubs[0].samplers() == {rec.label: i % 6 for i, rec in enumerate(recs)}  # 12 labels of their own
    finally:
        _close(recs, pubs)
