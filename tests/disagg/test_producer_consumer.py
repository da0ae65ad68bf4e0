"""Prefill -> decode over real sockets between real processes: layer-wise, resharded, failures."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from _kvsim import global_kv, unshard
from _procs import ProducerProcess
from tiersync.disagg import (
    DisaggConfig,
    KVConsumer,
    KVOrder,
    KVProducer,
    PagedKVLayout,
    RequestState,
    SourceSpec,
)
from tiersync.net.errors import AuthError, NetTimeoutError, PeerClosedError, RequestError
from tiersync.net.fields import ErrorCode

TOKEN = b"k" * 32


def _layout(tp, bs=16, nb=16, order=KVOrder.KV_MAJOR, heads=4, layers=4):
    return PagedKVLayout(
        num_layers=layers,
        num_kv_heads=heads,
        head_dim=8,
        block_size=bs,
        num_blocks=nb,
        dtype="float16",
        tp_size=tp,
        order=order,
    )


def _landing(layout):
    return [np.zeros(layout.layer_nbytes, np.uint8) for _ in range(layout.num_layers)]


@pytest.fixture
def procs():
    started = []

    def start(layout, ranks=None, **cfg):
        p = ProducerProcess(layout, range(layout.tp_size) if ranks is None else ranks, **cfg)
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()


def test_layerwise_byte_exact_in_ready_order(procs):
    src, dst = _layout(1, bs=16), _layout(1, bs=32, order=KVOrder.BLOCK_MAJOR)
    ntok, sids, dids = 70, [5, 1, 9, 3, 7], [2, 0, 6]
    prod = procs(src, token=TOKEN)
    prod.register("r1", sids, ntok, seed=3)
    seen = []
    with KVConsumer(dst, 0, DisaggConfig(token=TOKEN)) as consumer:
        landing = _landing(dst)
        handle = consumer.start_read(
            "r1",
            SourceSpec(src, prod.addresses, sids, ntok),
            dids,
            landing,
            on_layer=lambda rid, layer: seen.append((rid, layer)),
        )
        for layer in (0, 1, 3, 2):
            assert prod.ready("r1", [layer]) == [[True]]
            assert handle.wait_layer(layer, timeout=20)
            assert handle.arrived_layers[-1] == layer
        assert handle.wait_layer(0, timeout=0)  # already there
        assert handle.wait(10) is RequestState.DONE
        assert handle.arrived_layers == (0, 1, 3, 2)
        assert seen == [("r1", 0), ("r1", 1), ("r1", 3), ("r1", 2)]
        status = consumer.poll()
        assert status.done_receiving == {"r1"} and not status.failed_receiving
    np.testing.assert_array_equal(unshard(dst, [landing], dids, ntok), global_kv(src, ntok, 3))
    assert prod.wait_final("r1") == ["done"]


def test_wait_progress_wakes_on_final_until_polled(procs):
    layout, ntok, ids = _layout(1), 40, [3, 0, 7]
    prod = procs(layout, token=TOKEN)
    prod.register("r1", ids, ntok, seed=5)
    with KVConsumer(layout, 0, DisaggConfig(token=TOKEN)) as consumer:
        assert consumer.wait_progress(0.01) is False  # nothing in flight
        handle = consumer.start_read("r1", SourceSpec(layout, prod.addresses, ids, ntok), ids, _landing(layout))
        assert consumer.wait_progress(0.05) is False  # no layer is ready on the producer yet
        assert prod.ready("r1", range(layout.num_layers)) == [[True] * layout.num_layers]
        assert consumer.wait_progress(20) is True
        assert handle.state is RequestState.DONE
        assert consumer.wait_progress(0) is True  # stays set until poll reports it
        assert consumer.poll().done_receiving == {"r1"}
        assert consumer.wait_progress(0.01) is False
    assert prod.wait_final("r1") == ["done"]


def test_producer_wait_progress_wakes_on_done_and_abort():
    layout, ntok, ids = _layout(1), 40, [3, 0, 7]
    layers = [np.full(layout.layer_nbytes, 7, np.uint8) for _ in range(layout.num_layers)]
    with KVProducer(layout, 0) as prod, KVConsumer(layout, 0) as consumer:
        prod.register("r1", ids, ntok, layers)
        prod.register("r2", ids, ntok, layers)
        assert prod.wait_progress(0.01) is False
        consumer.start_read("r1", SourceSpec(layout, (prod.address,), ids, ntok), ids, _landing(layout))
        for layer in range(layout.num_layers):
            prod.layer_ready("r1", layer)
        assert prod.wait_progress(20) is True  # the reader acknowledged every layer
        assert prod.poll().done_sending == {"r1"}
        assert prod.wait_progress(0.01) is False
        prod.abort("r2")
        assert prod.wait_progress(0) is True
        assert prod.poll().failed_sending == {"r2"}


def test_layer_not_delivered_before_ready(procs):
    src = _layout(1)
    prod = procs(src)
    prod.register("r", [0, 1], 20)
    consumer = KVConsumer(src, 0)
    handle = consumer.start_read("r", SourceSpec(src, prod.addresses, [0, 1], 20), [3, 4], _landing(src))
    prod.ready("r", [1])
    assert handle.wait_layer(1, timeout=20)
    assert not handle.wait_layer(0, timeout=0.3)  # layer 0 was never declared ready
    assert handle.arrived_layers == (1,)
    consumer.close()
    assert consumer.poll().failed_receiving == {"r"}


@pytest.mark.parametrize(
    "a,b,bs_a,bs_b,heads",
    [
        (1, 2, 16, 32, 4),
        (2, 1, 32, 16, 4),
        (2, 4, 16, 16, 4),
        (4, 2, 8, 16, 4),
        (4, 1, 16, 16, 2),
    ],
)
def test_resharded_transfer_byte_exact(procs, a, b, bs_a, bs_b, heads):
    src = _layout(a, bs=bs_a, order=KVOrder.BLOCK_MAJOR, heads=heads, layers=3)
    dst = _layout(b, bs=bs_b, nb=20, heads=heads, layers=3)
    ntok = 45
    sids = list(range(src.blocks_needed(ntok)))[::-1]
    dids = [19 - 2 * i for i in range(dst.blocks_needed(ntok))]
    prod = procs(src, token=TOKEN)
    prod.register("q", sids, ntok, seed=11)
    prod.ready("q", range(3))
    consumers = [KVConsumer(dst, d, DisaggConfig(token=TOKEN)) for d in range(b)]
    landings = [_landing(dst) for _ in range(b)]
    source = SourceSpec.from_dict(SourceSpec(src, prod.addresses, sids, ntok).to_dict())
    handles = [c.start_read("q", source, dids, land) for c, land in zip(consumers, landings)]
    assert [h.wait(30) for h in handles] == [RequestState.DONE] * b
    np.testing.assert_array_equal(unshard(dst, landings, dids, ntok), global_kv(src, ntok, 11))
    assert prod.wait_final("q") == ["done"] * a  # unused replicas were notified and finished too
    assert all(c.poll().done_receiving == {"q"} for c in consumers)


def test_a_prefill_restarted_on_the_same_ports_is_read_at_once(procs):
    """The consumer's pooled connections to a prefill that restarted were hung up: the next read
    connects anew instead of failing on them."""
    src = _layout(1)
    first = procs(src, token=TOKEN)
    ports = [int(a.rsplit(":", 1)[1]) for a in first.addresses]
    with KVConsumer(src, 0, DisaggConfig(token=TOKEN)) as consumer:
        for run, prod in enumerate((first, None)):
            if prod is None:
                first.stop()
                prod = procs(src, ports=ports, token=TOKEN)
                assert prod.addresses == first.addresses
            rid = f"r{run}"
            prod.register(rid, [0, 1, 2], 40, seed=run)
            prod.ready(rid, range(src.num_layers))
            landing = _landing(src)
            handle = consumer.start_read(rid, SourceSpec(src, prod.addresses, [0, 1, 2], 40), [3, 4, 5], landing)
            assert handle.wait(20) is RequestState.DONE, handle.error
            np.testing.assert_array_equal(unshard(src, [landing], [3, 4, 5], 40), global_kv(src, 40, run))


def test_producer_sigkilled_mid_transfer(procs):
    src = _layout(1, layers=6)
    prod = procs(src)
    prod.register("k", [0, 1, 2], 40)
    prod.ready("k", [0, 1])
    consumer = KVConsumer(src, 0, DisaggConfig(timeout_s=60))
    handle = consumer.start_read("k", SourceSpec(src, prod.addresses, [0, 1, 2], 40), [5, 6, 7], _landing(src))
    assert handle.wait_layer(1, timeout=20)
    prod.kill()
    assert handle.wait(timeout=20) is RequestState.FAILED  # long before the 60 s deadline
    assert isinstance(handle.error, PeerClosedError)
    with pytest.raises(PeerClosedError):
        handle.wait_layer(2, timeout=1)
    status = consumer.poll()
    assert status.failed_receiving == {"k"} and not status.done_receiving
    assert consumer.get("k") is None  # released: nothing of it is tracked or written any more


def test_timeouts_fail_both_sides_never_done(procs):
    src = _layout(1)
    prod = procs(src, timeout_s=1.0)
    prod.register("t", [0], 10)
    consumer = KVConsumer(src, 0, DisaggConfig(timeout_s=30))
    handle = consumer.start_read("t", SourceSpec(src, prod.addresses, [0], 10), [1], _landing(src))
    assert prod.wait_final("t") == ["failed"]  # expired producer send: FAILED, not done
    assert handle.wait(20) is RequestState.FAILED
    assert prod.ready("t", [0]) == [[False]]
    assert consumer.poll().failed_receiving == {"t"}

    prod2 = procs(src)
    prod2.register("u", [0], 10)
    short = KVConsumer(src, 0, DisaggConfig(timeout_s=0.5))
    h2 = short.start_read("u", SourceSpec(src, prod2.addresses, [0], 10), [1], _landing(src))
    assert h2.wait(20) is RequestState.FAILED
    assert isinstance(h2.error, NetTimeoutError)
    assert short.poll().failed_receiving == {"u"}


def test_bad_token_refused_then_good_token_served(procs, caplog):
    src = _layout(1)
    prod = procs(src, token=TOKEN)
    prod.register("a", [0], 10)
    prod.ready("a", range(4))
    source = SourceSpec(src, prod.addresses, [0], 10)
    for cfg in (DisaggConfig(token=b"x" * 32), DisaggConfig()):
        bad = KVConsumer(src, 0, cfg)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tiersync.disagg.consumer"):
            h = bad.start_read("a", source, [1], _landing(src))
            assert h.wait(20) is RequestState.FAILED
        assert isinstance(h.error, AuthError)
        # the client says so at WARNING too, not only through the handle (a refused token is a
        # configuration fault someone must see)
        assert [r.levelno for r in caplog.records if "read of a from" in r.getMessage()] == [logging.WARNING]
    good = KVConsumer(src, 0, DisaggConfig(token=TOKEN))
    assert good.start_read("a", source, [1], _landing(src)).wait(20) is RequestState.DONE
    assert prod.wait_final("a") == ["done"]


def test_unknown_request_and_mismatch_refused(procs):
    src = _layout(1)
    prod = procs(src)
    prod.register("m", [0, 1], 20)
    consumer = KVConsumer(src, 0)
    h = consumer.start_read("nope", SourceSpec(src, prod.addresses, [0, 1], 20), [1, 2], _landing(src))
    assert h.wait(20) is RequestState.FAILED
    assert isinstance(h.error, RequestError) and h.error.code is ErrorCode.NOT_FOUND
    h = consumer.start_read("m", SourceSpec(src, prod.addresses, [1, 0], 20), [1, 2], _landing(src))
    assert h.wait(20) is RequestState.FAILED and h.error.code is ErrorCode.BAD_REQUEST and "mismatch" in h.error.message


@pytest.mark.parametrize(("blocks", "first", "n"), [([4, 2], 0, 32), ([2], 1, 16), ([2, 7], 1, 24), ([4, 2, 7], 0, 40)])
def test_a_reader_may_take_a_run_of_the_registered_blocks(procs, blocks, first, n):
    src = _layout(1)
    prod = procs(src)
    prod.register("p", [4, 2, 7], 40, seed=9)  # 2 blocks of 16 tokens and 8 of a third
    prod.ready("p", range(src.num_layers))
    # past the registration's last token, or not a run of its blocks: refused by the producer
    for ids, count in (([2, 7], 32), ([4, 2, 7], 41), ([7, 4], 32), ([4, 7], 32)):
        with KVConsumer(src, 0) as consumer:
            h = consumer.start_read("p", SourceSpec(src, prod.addresses, ids, count), [1, 3, 5], _landing(src))
            assert h.wait(20) is RequestState.FAILED and "mismatch" in h.error.message
    landing, dst = _landing(src), [9, 1, 0][: len(blocks)]
    with KVConsumer(src, 0) as consumer:
        h = consumer.start_read("p", SourceSpec(src, prod.addresses, blocks, n), dst, landing)
        assert h.wait(20) is RequestState.DONE
    got = unshard(src, [landing], dst, n)
    np.testing.assert_array_equal(got, global_kv(src, 40, 9)[:, :, 16 * first : 16 * first + n])
    others = [b for b in range(16) if b not in dst]
    assert not unshard(src, [landing], others, 16 * len(others)).any()  # no other block written


def test_landing_never_written_after_failure(procs):
    src = _layout(1)
    prod = procs(src)
    prod.register("c", [0, 1], 20, seed=5)
    prod.ready("c", [0])
    consumer = KVConsumer(src, 0)
    landing = _landing(src)
    handle = consumer.start_read("c", SourceSpec(src, prod.addresses, [0, 1], 20), [2, 3], landing)
    assert handle.wait_layer(0, timeout=20)
    consumer.close()  # the decode side gives up: the request fails and its landing is released
    assert handle.state is RequestState.FAILED
    snapshot = [layer.copy() for layer in landing]
    prod.ready("c", [1, 2, 3])
    assert prod.wait_final("c") == ["failed"]  # the producer's pushes hit a closed reader
    assert all(np.array_equal(a, b) for a, b in zip(landing, snapshot))
    assert not any(layer.any() for layer in landing[1:])
    assert consumer.poll().failed_receiving == {"c"}


def test_a_gathered_pull_that_outlives_its_session_leaves_no_staging_buffer(monkeypatch):
    """A pull still being prepared when its request is failed (poll's deadline, abort): the
    session is closed and forgotten meanwhile, so the gather buffer the pull then takes must not
    be kept under that session's id (up to the frame size, for the producer's lifetime)."""
    import threading

    from tiersync.disagg import layer_reads
    from tiersync.net.config import Route

    src = _layout(1, order=KVOrder.HEAD_MAJOR)  # many small spans per pull: gathered
    dst = _layout(1)
    hit, go, staged = threading.Event(), threading.Event(), threading.Event()
    spans, staging_of = layer_reads.LayerReads.spans, layer_reads.LayerReads._staging_of

    def held_spans(self, *args):
        hit.set()
        go.wait(20)
        return spans(self, *args)

    def noted_staging_of(self, *args):
        try:
            return staging_of(self, *args)
        finally:
            staged.set()

    monkeypatch.setattr(layer_reads.LayerReads, "spans", held_spans)
    monkeypatch.setattr(layer_reads.LayerReads, "_staging_of", noted_staging_of)
    layers = [np.random.default_rng(layer).integers(0, 255, src.layer_nbytes, dtype=np.uint8) for layer in range(4)]
    with (
        KVProducer(src, 0, DisaggConfig(token=TOKEN)) as prod,
        KVConsumer(dst, 0, DisaggConfig(token=TOKEN, route=Route.TCP)) as consumer,
    ):
        prod.register("r", list(range(8)), 128, layers)
        for layer in range(4):
            prod.layer_ready("r", layer)
        handle = consumer.start_read(
            "r", SourceSpec(src, [prod.address], list(range(8)), 128), list(range(8, 16)), _landing(dst)
        )
        assert hit.wait(20)
        assert prod.abort("r", "timed out")
        go.set()
        assert handle.wait(20) is RequestState.FAILED
        assert staged.wait(20)
        assert prod._reads._staging == {}


@pytest.mark.parametrize("route", ["tcp", "local"])
def test_gather_buffers_of_finished_reads_do_not_stay_with_idle_pooled_connections(route):
    """A decode engine keeps its connections to a prefill rank open and idle between reads. The
    gather buffers of a read (up to a frame each) go, at its KV_DONE, to at most two spares the
    next reads take, not stay with its connection: four reads at once on four connections, then
    the producer holds no session's buffer and at most two spares; the bytes are exact. On the
    same host the reader copies a gathered pull out of the buffer after the answer was sent: a
    spare taken for it used to be dropped at once (its memory freed under the reader)."""
    from tiersync.net.config import Route

    src, dst = _layout(1, order=KVOrder.HEAD_MAJOR), _layout(1)  # many small spans per pull: gathered
    layers = [np.random.default_rng(layer).integers(0, 255, src.layer_nbytes, dtype=np.uint8) for layer in range(4)]
    with (
        KVProducer(src, 0, DisaggConfig(token=TOKEN)) as prod,
        KVConsumer(dst, 0, DisaggConfig(token=TOKEN, route=Route(route))) as consumer,
    ):
        for round_ in range(2):  # the second round's reads take the spares
            names = [f"g{round_}-{i}" for i in range(4)]
            for name in names:
                prod.register(name, list(range(8)), 128, layers)
            landings = [_landing(dst) for _ in names]
            handles = [
                consumer.start_read(n, SourceSpec(src, [prod.address], list(range(8)), 128), list(range(8)), land)
                for n, land in zip(names, landings)
            ]
            for layer in range(4):
                for name in names:
                    prod.layer_ready(name, layer)
            assert [h.wait(30) for h in handles] == [RequestState.DONE] * 4
            want = unshard(src, [layers], list(range(8)), 128)
            for land in landings:
                np.testing.assert_array_equal(unshard(dst, [land], list(range(8)), 128), want)
            assert prod._reads._staging == {} and 1 <= len(prod._reads._spare) <= 2


def test_a_prefill_rank_lets_same_host_readers_trace_it_only_once_one_reads(monkeypatch):
    """prctl(PR_SET_PTRACER_ANY) (what process_vm_readv needs where Yama asks) widens who may
    trace the prefill engine: it used to be set at the start of any same-host session (a drop,
    a TCP read). It is set at the first same-host pull; a read over TCP leaves it alone."""
    from tiersync.net import local
    from tiersync.net.config import Route

    asked: list[bool] = []
    monkeypatch.setattr(local, "allow_readers", lambda: asked.append(True))
    src = dst = _layout(1)
    layers = [np.random.default_rng(layer).integers(0, 255, src.layer_nbytes, dtype=np.uint8) for layer in range(4)]
    with KVProducer(src, 0, DisaggConfig(token=TOKEN)) as prod:
        for route in ("tcp", "local"):
            prod.register(route, list(range(4)), 64, layers)
            for layer in range(4):
                prod.layer_ready(route, layer)
            land = _landing(dst)
            with KVConsumer(dst, 0, DisaggConfig(token=TOKEN, route=Route(route))) as consumer:
                handle = consumer.start_read(
                    route, SourceSpec(src, [prod.address], list(range(4)), 64), [4, 5, 6, 7], land
                )
                assert handle.wait(30) is RequestState.DONE, handle.error
            np.testing.assert_array_equal(
                unshard(dst, [land], [4, 5, 6, 7], 64), unshard(src, [layers], list(range(4)), 64)
            )
            assert bool(asked) is (route == "local"), (route, asked)
