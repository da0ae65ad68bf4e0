"""Block checksums a producer computes as layers become ready (``tiersync.disagg.blocksums``).

Invariants: a pull's spans are cut exactly at block boundaries (same bytes, each piece inside
one block region); every piece's checksum is tsum64 of exactly its bytes, whether it came from
the precomputed sums or was computed when asked; a same-host read of a request whose sums were
precomputed lands byte-exact (also when the route coalesced neighbouring blocks, so regions
are cut and destinations re-cut); a layer changed after ``layer_ready`` is refused by the
reader, never reported done.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from _kvsim import global_kv, shard, unshard
from tiersync.disagg import (
    DisaggConfig,
    KVConsumer,
    KVOrder,
    KVProducer,
    PagedKVLayout,
    RequestState,
    SourceSpec,
)
from tiersync.disagg.blocksums import BlockSums, _cut
from tiersync.disagg.layer_reads import Code, Refused
from tiersync.disagg.link import _placed
from tiersync.errors import UsageError
from tiersync.net import local
from tiersync.transfer.kernel import TSUM64, tsum64

needs_native = pytest.mark.skipif(
    TSUM64 is None or not local.can_read(os.getpid()), reason="needs the native checksum and process_vm_readv"
)


def _layout(order: KVOrder) -> PagedKVLayout:
    return PagedKVLayout(
        num_layers=3, num_kv_heads=4, head_dim=16, block_size=16, num_blocks=40, dtype="float16", tp_size=1, order=order
    )


@pytest.mark.parametrize("offs,lens", [([0, 100, 5000], [10, 4000, 3]), ([0], [1 << 16]), ([7], [0]), ([], [])])
def test_cut_splits_only_at_unit_boundaries(offs, lens):
    unit = 1024
    got_o, got_l = _cut(np.array(offs, np.int64), np.array(lens, np.int64), unit)
    whole = np.concatenate([np.arange(o, o + n) for o, n in zip(offs, lens)] or [np.zeros(0)])
    pieces = np.concatenate([np.arange(o, o + n) for o, n in zip(got_o, got_l)] or [np.zeros(0)])
    np.testing.assert_array_equal(pieces, whole)
    assert all(o // unit == (o + n - 1) // unit for o, n in zip(got_o, got_l) if n)


def test_placed_follows_region_lengths_or_refuses_a_straddle():
    """Destination spans [0, 40) and [50, 100) of a layer; the producer's regions cut finer."""
    offs, lens = np.array([0, 50], np.int64), np.array([40, 50], np.int64)

    def placed(lengths):
        lengths = np.array(lengths, np.int64)
        got = _placed(np.cumsum(lengths) - lengths, lengths, offs, lens)
        return None if got is None else got.tolist()

    assert placed([10, 30, 25, 25]) == [0, 10, 50, 75]
    assert placed([40, 50]) == [0, 50]
    assert placed([40, 50, 0]) == [0, 50, 100]  # an empty last region lands at the end
    assert placed([30, 30, 30]) is None  # the second region would straddle both spans
    assert placed([40, 60]) is None  # past the last span
    assert _placed(np.zeros(1, np.int64), np.ones(1, np.int64), offs[:0], lens[:0]) is None


class _Req:
    def __init__(self, ids, views):
        self.block_ids, self.views, self.sums = tuple(ids), views, {}
        self.state = RequestState.PENDING


@needs_native
@pytest.mark.parametrize("order", list(KVOrder))
def test_regions_carry_tsum64_of_their_bytes_precomputed_or_not(order):
    layout = _layout(order)
    ids = [3, 4, 5, 9, 0, 1]
    views = [np.random.default_rng(i).integers(0, 256, layout.layer_nbytes, dtype=np.uint8) for i in range(3)]
    sums = BlockSums(layout, threads=2)
    req = _Req(ids, views)
    sums.enable()
    sums.submit(req, 1)
    deadline = time.monotonic() + 10
    while 1 not in req.sums and time.monotonic() < deadline:
        time.sleep(0.01)
    sums.close()
    assert len(req.sums[1]) == len(ids) * (2 if order is KVOrder.KV_MAJOR else 1)
    offs = np.array([3 * sums.unit, 9 * sums.unit + 5, 0], np.int64)
    lens = np.array([3 * sums.unit, sums.unit, 2 * sums.unit - 1], np.int64)  # coalesced, offset and short spans
    for known in (req.sums[1], None):
        o, n, s = sums.regions(views[1], known, offs, lens)
        assert int(n.sum()) == int(lens.sum())
        assert s.tolist() == [tsum64(views[1][a : a + b]) for a, b in zip(o.tolist(), n.tolist())]


@needs_native
@pytest.mark.parametrize("order", list(KVOrder))
def test_composed_is_the_checksum_of_a_pulls_bytes_back_to_back(order):
    layout = _layout(order)
    ids = [3, 4, 5, 9, 0, 1]
    view = np.random.default_rng(7).integers(0, 256, layout.layer_nbytes, dtype=np.uint8)
    sums, req = BlockSums(layout, threads=2), _Req(ids, [view] * 3)
    sums.enable()
    known = sums.known(req, 0)
    sums.close()
    u = sums.unit
    cases = [
        ([3 * u, 9 * u, 0], [3 * u, u, 2 * u]),  # whole regions, coalesced neighbours
        ([3 * u + 64, 9 * u], [2 * u - 64, u - 1]),  # a pull cut inside regions, stripes whole
        ([0], [5]),  # one short piece
    ]
    for offs, lens in cases:
        offs, lens = np.array(offs, np.int64), np.array(lens, np.int64)
        want = tsum64([memoryview(view[o : o + n]) for o, n in zip(offs.tolist(), lens.tolist())])
        assert sums.composed(view, known, offs, lens) == want
    odd = np.array([3 * u, 9 * u], np.int64), np.array([u - 1, u], np.int64)  # a piece not whole stripes
    assert sums.composed(view, known, *odd) is None
    assert sums.composed(view, None, *cases[0]) is None  # nothing known: the stack sums the bytes


@needs_native
def test_a_layer_is_summed_once_whether_the_thread_or_a_pull_gets_there_first(monkeypatch):
    """Pulls asking for a layer's sums while the thread is queued or busy with them never sum
    it a second time; every answer equals tsum64 of the block."""
    from tiersync.disagg import blocksums

    layout = _layout(KVOrder.HEAD_MAJOR)
    ids = [3, 4, 5, 9, 0, 1]
    views = [np.random.default_rng(i).integers(0, 256, layout.layer_nbytes, dtype=np.uint8) for i in range(3)]
    calls = []
    real = blocksums.local.sum_ranges
    monkeypatch.setattr(blocksums.local, "sum_ranges", lambda v, *a: calls.append(v.ctypes.data) or real(v, *a))
    sums, req = BlockSums(layout, threads=2), _Req(ids, views)
    assert sums.known(req, 0) is None and not calls  # not enabled: the pull sums what it sends
    sums.enable()
    for layer in range(3):
        sums.submit(req, layer)
    got = [sums.known(req, layer) for layer in (2, 1, 0)][::-1]  # racing the thread's queue
    sums.close()
    assert sorted(calls) == sorted(v.ctypes.data for v in views)  # each layer once
    for view, known in zip(views, got):
        assert known.values.tolist() == [tsum64(view[o : o + sums.unit]) for o in known.offsets.tolist()]


@needs_native
def test_the_thread_skips_the_layers_of_requests_no_longer_pending(monkeypatch):
    """A layer queued for summing ahead whose request was read, dropped or timed out meanwhile
    is skipped: its buffers may already hold another request's KV (the engine reuses its
    blocks), and summing them would take a core from live transfers for nothing."""
    from tiersync.disagg import blocksums

    layout = _layout(KVOrder.HEAD_MAJOR)
    views = [np.ones(layout.layer_nbytes, np.uint8) for _ in range(3)]
    calls = []
    real = blocksums.local.sum_ranges
    monkeypatch.setattr(blocksums.local, "sum_ranges", lambda v, *a: calls.append(v.ctypes.data) or real(v, *a))
    sums = BlockSums(layout, threads=1)
    done, live = _Req([3, 4], views), _Req([5, 6], views)
    done.state = RequestState.DONE
    sums.enable()
    for layer in range(3):
        sums.submit(done, layer)
    sums.submit(live, 0)
    sums.close()  # sums what is queued, then ends
    assert done.sums == {} and list(live.sums) == [0] and len(calls) == 1


@needs_native
def test_the_thread_keeps_no_summed_request_and_close_ends_it():
    """The summing thread lets go of a request once its layer is summed (not at its next job),
    and close() returns once the thread has ended and refuses to start it again: a request's
    buffers freed on that thread while the interpreter shuts down abort the process when torch
    owns them ("terminate called without an active exception", seen at the exit of bench pd's
    producer)."""
    import gc
    import weakref

    layout = _layout(KVOrder.HEAD_MAJOR)
    sums = BlockSums(layout, threads=1)
    req = _Req([3, 4, 5], [np.ones(layout.layer_nbytes, np.uint8)])
    sums.enable()
    thread = sums._thread
    sums.submit(req, 0)
    assert sums.known(req, 0) is not None
    gone = weakref.ref(req)
    del req
    end = time.monotonic() + 10
    while gone() is not None and time.monotonic() < end:  # the thread takes the job, finds it done
        gc.collect()
        time.sleep(0.01)
    assert gone() is None and thread.is_alive()
    sums.close()
    assert not thread.is_alive() and not sums.enabled
    sums.enable()
    assert not sums.enabled


def _serve(layout, ids, ntok, seed):
    bufs = shard(layout, global_kv(layout, ntok, seed), ids)[0]
    return bufs


def _read(consumer, producer, layout, rid, ids, ntok):
    land = [np.zeros(layout.layer_nbytes, np.uint8) for _ in range(layout.num_layers)]
    handle = consumer.start_read(rid, SourceSpec(layout, (producer.address,), ids, ntok), ids, land)
    return handle, land


@needs_native
@pytest.mark.parametrize("route", ["local", "tcp"])
def test_reads_from_precomputed_sums_are_exact_and_changes_are_refused(route):
    """Same host: each region's sum; TCP: each DATA's checksum composed from the regions'."""
    layout = _layout(KVOrder.HEAD_MAJOR)
    ids, ntok = list(range(4, 14)), 150  # neighbours on both sides: the route coalesces them
    config = DisaggConfig(route=route, timeout_s=30)
    with KVProducer(layout, 0, config) as producer, KVConsumer(layout, 0, config) as consumer:
        for n, rid in enumerate(["first", "summed", "changed"]):
            bufs = _serve(layout, ids, ntok, seed=n)
            producer.register(rid, ids, ntok, bufs)
            for layer in range(layout.num_layers):
                producer.layer_ready(rid, layer)
            producer.settle(rid)
            # before any reader nothing is summed ahead; after one, settle has every layer's sums
            assert len(producer._requests[rid].sums) == (0 if rid == "first" else layout.num_layers)
            if rid == "changed":
                bufs[1][ids[2] * 2 * layout.block_nbytes] ^= 0xFF  # after layer_ready: the contract broken
            handle, land = _read(consumer, producer, layout, rid, ids, ntok)
            state = handle.wait(30)
            if rid == "changed":
                assert state is RequestState.FAILED and "checksum" in str(handle.error)
            else:
                assert state is RequestState.DONE, handle.error
                np.testing.assert_array_equal(unshard(layout, [land], ids, ntok), global_kv(layout, ntok, n))


def test_settle_refuses_an_unknown_request_and_is_a_no_op_once_it_finished():
    layout = _layout(KVOrder.HEAD_MAJOR)
    ids, ntok = [1, 2], 20
    config = DisaggConfig(route="local", timeout_s=30)
    with KVProducer(layout, 0, config) as producer:
        with pytest.raises(UsageError, match="request_id"):
            producer.settle("never-registered")
        producer.register("r", ids, ntok, _serve(layout, ids, ntok, seed=1))
        producer.abort("r")
        assert producer.state("r") is RequestState.FAILED
        producer.settle("r")  # finished: nothing to sum, no error


class _BadAddressProducer(KVProducer):
    """Names an unmapped address for the second layer's regions: the kernel refuses the copy."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        answer = self._reads.pull_local

        def pull_local(session, route, event):
            reply = answer(session, route, event)
            if event.n != 1:
                return reply
            regions = reply.regions.copy()
            regions[:, 0] = 8
            return type(reply)(reply.request_id, reply.pid, reply.algo, regions)

        self._reads.pull_local = pull_local


class _NotSameHostProducer(KVProducer):
    """Refuses every KV_PULL_LOCAL as a producer does that counts the reader as on another host
    (the two ends disagree: NAT, a redirect)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)

        def pull_local(session, route, event):
            raise Refused(Code.UNSUPPORTED, "KV_PULL_LOCAL from another host")

        self._reads.pull_local = pull_local


@needs_native
@pytest.mark.parametrize(
    ("producer_cls", "route", "why"),
    [
        (_BadAddressProducer, "auto", None),  # layer 0 through memory, the rest over the socket
        (_BadAddressProducer, "local", "process_vm_readv"),
        (_NotSameHostProducer, "auto", None),  # every pull refused (two in flight): all over the socket
        (_NotSameHostProducer, "local", "another host"),
    ],
)
def test_a_refused_same_host_read_falls_back_to_tcp_or_fails(producer_cls, route, why):
    """A copy the kernel refuses, or a producer that answers UNSUPPORTED (it does not count the
    reader as on this host while the reader does): route AUTO reads the rest over TCP,
    byte-exact; route LOCAL fails the read saying why."""
    layout = _layout(KVOrder.HEAD_MAJOR)
    ids, ntok = [7, 3, 12, 5], 60
    with (
        producer_cls(layout, 0, DisaggConfig(timeout_s=30)) as producer,
        KVConsumer(layout, 0, DisaggConfig(route=route, timeout_s=30)) as consumer,
    ):
        producer.register("r", ids, ntok, _serve(layout, ids, ntok, seed=5))
        for layer in range(layout.num_layers):
            producer.layer_ready("r", layer)
        handle, land = _read(consumer, producer, layout, "r", ids, ntok)
        state = handle.wait(30)
        if why is None:
            assert state is RequestState.DONE, handle.error
            np.testing.assert_array_equal(unshard(layout, [land], ids, ntok), global_kv(layout, ntok, 5))
        else:
            assert state is RequestState.FAILED and why in str(handle.error)


@needs_native
def test_a_long_request_of_small_blocks_is_read_in_pieces_whose_replies_fit_max_keys():
    """8 KiB block regions, 4200 consecutive blocks (one coalesced span of 34 MB per layer):
    a pull of a whole layer would be answered by more regions than a LOCAL_REPLY may carry, so
    the reader asks in pieces the producer can describe; every byte lands."""
    layout = PagedKVLayout(
        num_layers=2, num_kv_heads=1, head_dim=128, block_size=16, num_blocks=4200, dtype="float16", tp_size=1
    )
    ids, ntok = list(range(4200)), 4200 * 16
    config = DisaggConfig(route="local", timeout_s=60)
    with KVProducer(layout, 0, config) as producer, KVConsumer(layout, 0, config) as consumer:
        producer.register("long", ids, ntok, _serve(layout, ids, ntok, seed=3))
        for layer in range(layout.num_layers):
            producer.layer_ready("long", layer)
        handle, land = _read(consumer, producer, layout, "long", ids, ntok)
        assert handle.wait(60) is RequestState.DONE, handle.error
        np.testing.assert_array_equal(unshard(layout, [land], ids, ntok), global_kv(layout, ntok, 3))


class _HugeLengthProducer(KVProducer):
    """Answers layer 0 with a first region of length 2**64 - 1 and a second that makes the
    lengths add up modulo 2**64 (a lie no arithmetic on the reader's side may accept)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        answer = self._reads.pull_local

        def pull_local(session, route, event):
            reply = answer(session, route, event)
            regions = reply.regions.copy()
            if len(regions) >= 2:
                regions[1, 1] += regions[0, 1] + np.uint64(1)
                regions[0, 1] = np.uint64(2**64 - 1)
            return type(reply)(reply.request_id, reply.pid, reply.algo, regions)

        self._reads.pull_local = pull_local


@needs_native
def test_a_region_longer_than_the_pull_is_a_protocol_error():
    layout = _layout(KVOrder.HEAD_MAJOR)
    ids, ntok = [7, 3, 12, 5], 60
    with (
        _HugeLengthProducer(layout, 0, DisaggConfig(timeout_s=30)) as producer,
        KVConsumer(layout, 0, DisaggConfig(route="local", timeout_s=30)) as consumer,
    ):
        producer.register("r", ids, ntok, _serve(layout, ids, ntok, seed=5))
        for layer in range(layout.num_layers):
            producer.layer_ready("r", layer)
        handle, _ = _read(consumer, producer, layout, "r", ids, ntok)
        assert handle.wait(30) is RequestState.FAILED
        from tiersync.net.errors import ProtocolError, ProtocolFault

        assert isinstance(handle.error, ProtocolError) and handle.error.fault is ProtocolFault.MALFORMED
        assert "longer than the pull" in str(handle.error)


def test_without_the_native_checksum_nothing_is_summed_ahead_and_tcp_reads_work(monkeypatch):
    """No native tsum64: block sums stay off (pulls are summed by the stack as they are sent)."""
    from types import SimpleNamespace

    from tiersync.disagg import blocksums

    monkeypatch.setattr(blocksums, "kernel", SimpleNamespace(TSUM64=None))
    layout = _layout(KVOrder.HEAD_MAJOR)
    ids, ntok = list(range(4, 14)), 150
    config = DisaggConfig(route="tcp", timeout_s=30)
    with KVProducer(layout, 0, config) as producer, KVConsumer(layout, 0, config) as consumer:
        for n, rid in enumerate(["a", "b"]):
            producer.register(rid, ids, ntok, _serve(layout, ids, ntok, seed=n))
            for layer in range(layout.num_layers):
                producer.layer_ready(rid, layer)
            handle, land = _read(consumer, producer, layout, rid, ids, ntok)
            assert handle.wait(30) is RequestState.DONE, handle.error
            np.testing.assert_array_equal(unshard(layout, [land], ids, ntok), global_kv(layout, ntok, n))
        assert not producer._reads.sums.enabled  # no thread, no sums taken ahead
