"""One prefill -> decode link on the one wire stack: ops parsed defensively, same-host reads
byte-exact, TLS, the token, connections pooled across requests, route slices exact."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "net"))

from _kvsim import global_kv, unshard
from _procs import ProducerProcess
from tiersync.disagg import (
    DisaggConfig,
    KVConsumer,
    KVOrder,
    PagedKVLayout,
    RequestState,
    SourceSpec,
)
from tiersync.disagg.messages import ReadRequest
from tiersync.disagg.ops import KV, KvDone, KvLayer, KvNext, KvOpen, KvOpened, KvPull, KvPullLocal
from tiersync.disagg.spanio import route_slice
from tiersync.errors import UsageError
from tiersync.net.codec import MetaReader, MetaWriter
from tiersync.net.errors import AuthError, PeerClosedError, ProtocolError, ProtocolFault
from tiersync.net.frames import ProtocolConfig
from tiersync.net.tls import TlsConfig

TOKEN = "a-shared-token-of-32-characters!"
LAYOUT = PagedKVLayout(
    num_layers=3,
    num_kv_heads=4,
    head_dim=8,
    block_size=16,
    num_blocks=24,
    dtype="float16",
    tp_size=1,
    order=KVOrder.KV_MAJOR,
)


def _landing(layout):
    return [np.zeros(layout.layer_nbytes, np.uint8) for _ in range(layout.num_layers)]


def _roundtrip(event):
    return type(event).parse(event.request_id, MetaReader(event.meta()), ProtocolConfig())


def test_every_op_round_trips():
    read = ReadRequest("r", 0, 1, LAYOUT, (3, 4), (1, 2), 20, LAYOUT)
    for event in (
        KvOpen(5, read),
        KvOpened(5, 123, (1 << 64) - 1),
        KvNext(6, 2),
        KvLayer(6, 1),
        KvPull(7, 2, 10, 99),
        KvPullLocal(8, 1, 0, 4096),
        KvDone(9),
    ):
        assert _roundtrip(event) == event
    assert set(KV.ops) >= {int(c.OP) for c in (KvOpen, KvOpened, KvNext, KvLayer, KvPull, KvPullLocal, KvDone)}


@pytest.mark.parametrize(
    "cls,meta",
    [
        (KvPull, MetaWriter().u32(0).u64(0).u64(0).getvalue()),  # an empty pull
        (KvPull, MetaWriter().u32(0).u64(0).u64(1 << 40).getvalue()),  # over the frame size
        (KvPull, b"\x01\x02"),  # truncated
        (KvOpen, MetaWriter().blob(b"not json").getvalue()),
        (KvOpen, MetaWriter().json({"request_id": "r"}).getvalue()),  # missing fields
    ],
)
def test_hostile_metadata_is_malformed(cls, meta):
    with pytest.raises(ProtocolError) as e:
        cls.parse(1, MetaReader(meta), ProtocolConfig())
    assert e.value.fault is ProtocolFault.MALFORMED


def test_ops_validate_their_fields():
    for build, name in (
        (lambda: KvNext(1, 1 << 32), "n"),
        (lambda: KvPull(1, -1, 0, 1), "n"),
        (lambda: KvOpen(1, "read"), "read"),
    ):
        with pytest.raises(UsageError) as e:
            build()
        assert e.value.argument == name


@pytest.mark.parametrize("start,n", [(0, 60), (5, 10), (10, 20), (9, 2), (25, 35), (59, 1), (30, 30)])
def test_route_slice_is_exactly_the_bytes_asked_for(start, n):
    offsets, lengths = np.array([100, 200, 300]), np.array([10, 20, 30])
    whole = np.concatenate([np.arange(o, o + k) for o, k in zip(offsets, lengths)])
    offs, lens = route_slice(offsets, lengths, start, n)
    got = np.concatenate([np.arange(o, o + k) for o, k in zip(offs, lens)])
    assert (lens > 0).all()
    np.testing.assert_array_equal(got, whole[start : start + n])


@pytest.fixture
def procs():
    started = []

    def start(layout, **cfg):
        p = ProducerProcess(layout, range(layout.tp_size), **cfg)
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()


@pytest.mark.parametrize("route", ["local", "tcp"])
@pytest.mark.parametrize("dst_tp,chunk", [(1, 16 << 20), (2, 16 << 20), (2, 1000)])
def test_routes_byte_exact_across_processes(procs, route, dst_tp, chunk):
    """Route LOCAL never falls back to TCP, so DONE here means the bytes came out of the
    producer process's memory (process_vm_readv), verified; split heads make many small spans
    (400 spans of 32 bytes: the producer gathers them; with 1000-byte pulls each pull is ~30
    views of the host buffer); one TP rank: whole blocks."""
    src = LAYOUT
    dst = PagedKVLayout(
        num_layers=3,
        num_kv_heads=4,
        head_dim=8,
        block_size=8,
        num_blocks=64,
        dtype="float16",
        tp_size=dst_tp,
        order=KVOrder.BLOCK_MAJOR,
    )
    ntok, sids = 200, [9, 2, 7, 0, 5, 11, 1, 12, 3, 10, 4, 8, 6]
    dids = list(range(63, 63 - 2 * dst.blocks_needed(ntok), -2))
    prod = procs(src, token=TOKEN)
    prod.register("l", sids, ntok, seed=4)
    prod.ready("l", range(3))
    consumers = [KVConsumer(dst, d, DisaggConfig(token=TOKEN, route=route, chunk_bytes=chunk)) for d in range(dst_tp)]
    landings = [_landing(dst) for _ in range(dst_tp)]
    source = SourceSpec(src, prod.addresses, sids, ntok)
    handles = [c.start_read("l", source, dids, land) for c, land in zip(consumers, landings)]
    assert [h.wait(30) for h in handles] == [RequestState.DONE] * dst_tp, [h.error for h in handles]
    np.testing.assert_array_equal(unshard(dst, landings, dids, ntok), global_kv(src, ntok, 4))
    assert prod.wait_final("l") == ["done"]
    for c in consumers:
        c.close()


@pytest.mark.parametrize("route", ["local", "tcp"])
def test_a_producer_with_smaller_frames_gets_pulls_it_accepts(procs, route):
    """The producer's max_frame_size, told in the handshake, bounds the consumer's pulls: a
    consumer on the defaults (16 MiB pulls) reads a producer capped at 8 KiB frames (26 KB a
    layer here) byte-exact; before, every pull of a layer was refused."""
    capped = ProtocolConfig(max_frame_size=8192, max_meta_size=4096)
    prod = procs(LAYOUT, token=TOKEN, protocol=capped, chunk_bytes=4096)
    ntok, sids = 200, list(range(13))
    prod.register("f", sids, ntok, seed=6)
    prod.ready("f", range(3))
    with KVConsumer(LAYOUT, 0, DisaggConfig(token=TOKEN, route=route)) as consumer:
        land = _landing(LAYOUT)
        handle = consumer.start_read("f", SourceSpec(LAYOUT, prod.addresses, sids, ntok), list(range(13)), land)
        assert handle.wait(30) is RequestState.DONE, handle.error
    np.testing.assert_array_equal(unshard(LAYOUT, [land], list(range(13)), ntok), global_kv(LAYOUT, ntok, 6))
    assert prod.wait_final("f") == ["done"]


def test_tcp_layers_named_out_of_order_land_in_their_own_buffers(procs):
    """One pipeline over all layers: the pulls of a layer go out before KV_NEXT's answer named
    it, and still land in the buffer of the layer the answer named, each layer in several pulls."""
    prod = procs(LAYOUT)
    prod.register("o", [5, 6, 7], 40, seed=3)
    with KVConsumer(LAYOUT, 0, DisaggConfig(route="tcp", chunk_bytes=1000, window=3)) as consumer:
        land = _landing(LAYOUT)
        handle = consumer.start_read("o", SourceSpec(LAYOUT, prod.addresses, [5, 6, 7], 40), [1, 2, 3], land)
        ready: list[int] = []
        for layer in (2, 0, 1):
            prod.ready("o", [layer])
            ready.append(layer)
            assert handle.wait_layer(layer, timeout=20)
            assert not any(handle.wait_layer(other, timeout=0) for other in range(3) if other not in ready)
        assert handle.wait(20) is RequestState.DONE
    np.testing.assert_array_equal(unshard(LAYOUT, [land], [1, 2, 3], 40), global_kv(LAYOUT, 40, 3))
    assert prod.wait_final("o") == ["done"]


def test_connections_are_pooled_across_requests(procs):
    prod = procs(LAYOUT)
    with KVConsumer(LAYOUT, 0, DisaggConfig(route="tcp")) as consumer:
        for i in range(3):
            prod.register(f"p{i}", [i], 10, seed=i)
            prod.ready(f"p{i}", range(3))
            land = _landing(LAYOUT)
            assert (
                consumer.start_read(f"p{i}", SourceSpec(LAYOUT, prod.addresses, [i], 10), [i], land).wait(20)
                is RequestState.DONE
            )
            np.testing.assert_array_equal(unshard(LAYOUT, [land], [i], 10), global_kv(LAYOUT, 10, i))
            assert consumer._pool.idle_count(prod.addresses[0]) == 1  # the same connection, kept


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    pytest.importorskip("cryptography")
    from _certs import make_pki

    return make_pki(tmp_path_factory.mktemp("pki"), "server", "client")


def test_tls_with_token_byte_exact_and_plain_peer_refused(procs, pki):
    cert, key = pki["server"]
    prod = procs(LAYOUT, token=TOKEN, tls=TlsConfig(pki["ca"], cert, key, require_peer_cert=True))
    prod.register("t", [3, 4], 20, seed=9)
    prod.ready("t", range(3))
    source = SourceSpec(LAYOUT, prod.addresses, [3, 4], 20)
    plain = KVConsumer(LAYOUT, 0, DisaggConfig(token=TOKEN))
    h = plain.start_read("t", source, [1, 2], _landing(LAYOUT))
    assert h.wait(20) is RequestState.FAILED and isinstance(h.error, (AuthError, PeerClosedError, ProtocolError))
    plain.poll()
    ccert, ckey = pki["client"]
    with KVConsumer(LAYOUT, 0, DisaggConfig(token=TOKEN, route="tcp", tls=TlsConfig(pki["ca"], ccert, ckey))) as c:
        land = _landing(LAYOUT)
        assert c.start_read("t", source, [1, 2], land).wait(20) is RequestState.DONE
    np.testing.assert_array_equal(unshard(LAYOUT, [land], [1, 2], 20), global_kv(LAYOUT, 20, 9))
    assert prod.wait_final("t") == ["done"]


def test_token_from_a_str_and_a_peer_without_it_refused(procs):
    prod = procs(LAYOUT, token=TOKEN)
    prod.register("k", [0], 10)
    prod.ready("k", range(3))
    source = SourceSpec(LAYOUT, prod.addresses, [0], 10)
    for cfg in (DisaggConfig(), DisaggConfig(token="another-token-of-32-characters!!")):
        with KVConsumer(LAYOUT, 0, cfg) as bad:
            h = bad.start_read("k", source, [1], _landing(LAYOUT))
            assert h.wait(20) is RequestState.FAILED and isinstance(h.error, AuthError)
    with KVConsumer(LAYOUT, 0, DisaggConfig(token=TOKEN.encode())) as good:
        assert good.start_read("k", source, [1], _landing(LAYOUT)).wait(20) is RequestState.DONE


def test_a_producer_whose_pools_are_shared_is_copied_out_of_maps_byte_exact(procs, monkeypatch):
    """A producer told its pools' memfds (``share_all``, as the vLLM connector's producer is)
    names them in LOCAL_REPLY: the consumer copies the blocks in their whole pages out of maps
    of them and the rest (the first and the last block of a pool lie partly in its partial end
    pages) with process_vm_readv, every region verified, byte-exact. Blocks of 64 KiB as in
    vLLM's CPU layout, scattered through the pool, the first and the last block among them."""
    from tiersync.net import local

    rows = {"mapped": 0, "kernel": 0}
    real = local.read_summed_at

    def spy(pid, remote, dest, offsets, threads, mapped=None):
        rows["mapped" if mapped is not None else "kernel"] += len(remote)
        return real(pid, remote, dest, offsets, threads, mapped)

    monkeypatch.setattr(local, "read_summed_at", spy)
    big = PagedKVLayout(
        num_layers=2,
        num_kv_heads=8,
        head_dim=128,
        block_size=16,
        num_blocks=40,
        dtype="float16",
        tp_size=1,
        order=KVOrder.HEAD_MAJOR,
    )
    ntok, sids = 300, [39, 3, 17, 0, 25, 8, 31, 12, 5, 22, 36, 14, 1, 28, 9, 20, 33, 6, 11]
    dids = list(range(19))
    prod = procs(big, share=True, token=TOKEN)
    prod.register("s", sids, ntok, seed=6)
    prod.ready("s", range(2))
    consumer = KVConsumer(big, 0, DisaggConfig(token=TOKEN, route="local"))
    landing = _landing(big)
    try:
        handle = consumer.start_read("s", SourceSpec(big, prod.addresses, sids, ntok), dids, landing)
        assert handle.wait(30) is RequestState.DONE, handle.error
        np.testing.assert_array_equal(unshard(big, [landing], dids, ntok), global_kv(big, ntok, 6))
        assert rows["mapped"] >= 2 * (len(sids) - 2) and rows["kernel"] <= 2 * 2, rows  # 2 layers
    finally:
        consumer.close()
