"""KVDropper and KV_DROP: a decode scheduler tells prefill ranks (a real process, real sockets)
that a request will not be read; they free it at once, and only what the token allows."""

from __future__ import annotations

import logging
import socket
import threading
import time
from contextlib import closing

import pytest

from _procs import ProducerProcess
from tiersync.disagg import DisaggConfig, KVDropper, KVOrder, PagedKVLayout
from tiersync.disagg import dropper as dropper_mod
from tiersync.disagg.ops import KvDrop
from tiersync.errors import UsageError
from tiersync.net.codec import MetaReader, MetaWriter
from tiersync.net.errors import ProtocolError, ProtocolFault
from tiersync.net.frames import ProtocolConfig

TOKEN = b"d" * 32
LAYOUT = PagedKVLayout(
    num_layers=2, num_kv_heads=4, head_dim=8, block_size=16, num_blocks=16, dtype="float16", tp_size=2,
    order=KVOrder.KV_MAJOR,
)  # fmt: skip


@pytest.fixture(scope="module")
def prefill():
    """Two prefill ranks whose requests only a drop can end in time (timeout 600 s)."""
    p = ProducerProcess(LAYOUT, range(2), token=TOKEN, timeout_s=600)
    yield p
    p.stop()


def _closed_port() -> str:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_a_dropped_request_is_freed_at_every_rank_at_once(prefill):
    prefill.register("r-drop", [1, 2], 20)
    with closing(KVDropper(DisaggConfig(token=TOKEN))) as d:
        d.drop("r-drop", prefill.addresses)
        assert d.flush(20)
        assert d.confirmed == 2
        assert prefill.wait_final("r-drop", timeout=10) == ["failed", "failed"]
        d.drop("r-drop", prefill.addresses)  # already final there: answered, not confirmed
        d.drop("never-registered", prefill.addresses)
        assert d.flush(20) and d.confirmed == 2


def test_an_unreachable_rank_does_not_keep_the_others_from_being_told(prefill, caplog):
    """Nor does an address no resolver takes (the thread goes on); a rank that failed is not
    tried again for BACKOFF_S."""
    prefill.register("r-dead", [3], 10)
    prefill.register("r-dead2", [5], 10)
    dead = _closed_port()
    with (
        caplog.at_level(logging.INFO, logger="tiersync.disagg.dropper"),
        closing(KVDropper(DisaggConfig(token=TOKEN, connect_timeout_s=2))) as d,
    ):
        d.drop("r-dead", ("a" * 64 + ":1", dead, *prefill.addresses))
        d.drop("r-dead2", (dead, *prefill.addresses))
        assert d.flush(30) and d.confirmed == 4
    assert prefill.wait_final("r-dead", timeout=10) == ["failed", "failed"]  # r-dead2: confirmed by both
    assert caplog.text.count(f"at {dead}") == 1  # the second drop did not try it again


def test_a_request_a_reader_joined_is_not_dropped(prefill):
    """A drop that comes while a decode rank reads the request (a router that sent the same
    KV params to two decode requests, one aborted) is refused: the read still completes."""
    import numpy as np

    from tiersync.disagg import KVConsumer, RequestState, SourceSpec

    prefill.register("r-read", [6, 7], 20)
    landing = [np.zeros(LAYOUT.layer_nbytes, np.uint8) for _ in range(LAYOUT.num_layers)]
    with (
        KVConsumer(LAYOUT, 0, DisaggConfig(token=TOKEN)) as consumer,
        closing(KVDropper(DisaggConfig(token=TOKEN))) as d,
    ):
        handle = consumer.start_read("r-read", SourceSpec(LAYOUT, prefill.addresses, [6, 7], 20), [0, 1], landing)
        assert prefill.ready("r-read", [0]) == [[True], [True]]
        assert handle.wait_layer(0, timeout=20)  # the reader joined rank 0 and has a layer
        d.drop("r-read", prefill.addresses[:1])  # rank 0: the one this reader reads from
        assert d.flush(20) and d.confirmed == 0
        assert prefill.ready("r-read", [1]) == [[True], [True]]
        assert handle.wait(20) is RequestState.DONE


def test_a_peer_without_the_token_drops_nothing(prefill, caplog):
    prefill.register("r-kept", [4], 10)
    with (
        caplog.at_level(logging.INFO, logger="tiersync.disagg.dropper"),
        closing(KVDropper(DisaggConfig(token=b"x" * 32))) as d,
    ):
        d.drop("r-kept", prefill.addresses)
        assert d.flush(20) and d.confirmed == 0
    assert "could not drop r-kept" in caplog.text
    with closing(KVDropper(DisaggConfig(token=TOKEN))) as d:  # it was still pending: now it goes
        d.drop("r-kept", prefill.addresses)
        assert d.flush(20) and d.confirmed == 2


def test_bad_arguments_name_themselves_and_queue_nothing():
    with closing(KVDropper(DisaggConfig(token=TOKEN))) as d:
        for kv_request in ("", "x" * 257, 5, "\ud800"):
            with pytest.raises(UsageError) as info:
                d.drop(kv_request, ("127.0.0.1:1",))
            assert info.value.argument == "kv_request"
        for addresses in ("127.0.0.1:1", [""], [None], ()):
            with pytest.raises(UsageError) as info:
                d.drop("r", addresses)
            assert info.value.argument == "addresses"
        assert d.flush(5) and d.confirmed == 0
    with pytest.raises(UsageError) as info:
        KVDropper(config={"token": TOKEN})  # type: ignore[arg-type]
    assert info.value.argument == "config"


def test_at_most_max_pending_drops_wait(monkeypatch, caplog):
    """A rank that accepts and never answers holds a sender (up to its timeouts); meanwhile
    drops to it past the cap are not queued (logged once), and close does not wait for them."""
    monkeypatch.setattr(dropper_mod, "MAX_PENDING", 2)
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (backlog), never speaks
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        d = KVDropper(DisaggConfig(token=TOKEN, connect_timeout_s=3))
        try:
            d.drop("first", (address,))  # taken by the thread: it waits in the handshake
            assert _until(lambda: address in d._busy, 5)
            with caplog.at_level(logging.WARNING, logger="tiersync.disagg.dropper"):
                for i in range(5):
                    d.drop(f"r{i}", (address,))
            assert len(d._open) == 3 and d._waiting == 2  # the first (being sent), r0 and r1
            assert caplog.text.count("2 KV drops wait to be sent to 127.0.0.1") == 1
            assert d.flush(0.1) is False  # the first drop still holds its sender
        finally:
            closer = threading.Thread(target=d.close)
            closer.start()
            closer.join(30)
            assert not closer.is_alive()
        d.drop("after-close", (address,))  # a no-op
        assert not d._open


def test_a_hanging_ranks_full_lane_does_not_keep_drops_from_the_others(prefill, monkeypatch):
    """Drops wait per rank: a rank that accepts and never answers, named in every drop, fills
    its own lane (MAX_PENDING, 2 here) while its sender waits; the drops go on to the healthy
    ranks named with it. Before, a drop counted against the one cap until its slowest rank was
    told, so once two drops waited for it the healthy ranks were not told either."""
    monkeypatch.setattr(dropper_mod, "MAX_PENDING", 2)
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (backlog), never speaks
        hanging = f"127.0.0.1:{silent.getsockname()[1]}"
        d = KVDropper(DisaggConfig(token=TOKEN, connect_timeout_s=20, io_timeout_s=20))
        try:
            d.drop("r-lane-first", (hanging,))  # holds the sender of the hanging rank's lane
            assert _until(lambda: hanging in d._busy, 5)
            ids = [f"r-lane-{i}" for i in range(6)]
            for rid in ids:
                prefill.register(rid, [11], 10)
            for i, rid in enumerate(ids):  # each confirmed by the healthy ranks before the next
                d.drop(rid, (hanging, *prefill.addresses))
                assert _until(lambda i=i: d.confirmed >= 2 * (i + 1), 10), f"{d.confirmed} of {2 * (i + 1)}"
            assert len(d._lanes[hanging]) == 2
        finally:
            silent.close()
            d.close()


def test_at_most_max_waiting_drops_wait_over_every_rank(monkeypatch, caplog):
    """Ranks that hang hold all SENDERS senders; drops to other ranks wait in their lanes, at
    most MAX_WAITING (3 here) of them in all: the next is not queued (logged once, naming the
    overall cap), whichever rank it is for."""
    silent = [socket.create_server(("127.0.0.1", 0)) for _ in range(dropper_mod.SENDERS)]
    d = KVDropper(DisaggConfig(token=TOKEN, connect_timeout_s=5))
    try:
        for i, s in enumerate(silent):  # each holds a sender in its handshake
            d.drop(f"hold-{i}", (f"127.0.0.1:{s.getsockname()[1]}",))
        assert _until(lambda: len(d._busy) == dropper_mod.SENDERS, 5)
        monkeypatch.setattr(dropper_mod, "MAX_WAITING", 3)  # now: the holding drops waited a moment too
        with caplog.at_level(logging.WARNING, logger="tiersync.disagg.dropper"):
            for i in range(5):
                d.drop(f"wait-{i}", (f"127.0.0.1:{i + 1}",))  # five other ranks
        assert d._waiting == 3 and sorted(d._lanes) == [f"127.0.0.1:{i + 1}" for i in range(3)]
        assert caplog.text.count("3 KV drops wait to be sent: more are not sent") == 1
    finally:
        for s in silent:
            s.close()
        d.close()


def _until(condition, within: float) -> bool:
    """Whether ``condition()`` holds within ``within`` seconds (checked every few ms)."""
    end = time.monotonic() + within
    while not condition():
        if time.monotonic() >= end:
            return False
        time.sleep(0.005)  # re-checking a counter of the dropper's threads, not timing them
    return True


def test_a_rank_that_accepts_and_never_answers_does_not_delay_the_drops_to_the_others(prefill):
    """Each drop names a rank that accepts and never answers (a plain listening socket: each
    attempt there waits out the 5 s connect timeout) before the two healthy ranks. Before, the
    one sender waited there first, so the healthy ranks were told 5 s late (and again after
    each BACKOFF_S); now that rank holds one sender, and the drops to the others are confirmed
    within 1.5 s, round after round while it hangs."""
    bound_s = 1.5
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (backlog), never speaks
        hanging = f"127.0.0.1:{silent.getsockname()[1]}"
        d = KVDropper(DisaggConfig(token=TOKEN, connect_timeout_s=5, io_timeout_s=5))
        try:
            for round_ in range(3):
                ids = [f"r-hang-{round_}-{i}" for i in range(2)]
                for rid in ids:
                    prefill.register(rid, [9], 10)
                for rid in ids:
                    d.drop(rid, (hanging, *prefill.addresses))
                want = 4 * (round_ + 1)
                assert _until(lambda want=want: d.confirmed >= want, bound_s), (
                    f"round {round_}: {d.confirmed} of {want}"
                )
            assert d.flush(0.1) is False  # the hanging rank still holds its sender
        finally:
            silent.close()  # resets the connection the sender waits on
            d.close()


def test_a_failing_rank_waits_twice_as_long_each_time_up_to_a_cap_and_afresh_once_it_answers(prefill):
    healthy = prefill.addresses[0]
    with closing(KVDropper(DisaggConfig(token=TOKEN))) as d:
        waits = [d._backoff(healthy) for _ in range(6)]
        assert waits == [30.0, 60.0, 120.0, 240.0, 480.0, 480.0] and dropper_mod.BACKOFF_MAX_S == 480.0
        prefill.register("r-backoff", [10], 10)
        d.drop("r-backoff", (healthy,))  # within its wait: not tried
        assert d.flush(20) and d.confirmed == 0
        d._failed[healthy] = (time.monotonic() - 1, 480.0)  # its wait is over: tried, and it answers
        prefill.register("r-backoff2", [10], 10)
        d.drop("r-backoff2", (healthy,))
        assert d.flush(20) and d.confirmed == 1
        assert d._backoff(healthy) == 30.0  # its next failure backs off as a first one


def test_the_failures_remembered_are_bounded_and_each_is_forgotten_once():
    """Addresses come from requests: however many ranks fail, at most MAX_FAILED are
    remembered, those that failed longest ago going first (in O(1) each, under the lock)."""
    with closing(KVDropper(DisaggConfig(token=TOKEN))) as d:
        n = dropper_mod.MAX_FAILED + 100
        for i in range(n):
            d._backoff(f"10.0.{i // 256}.{i % 256}:9")
        assert len(d._failed) == dropper_mod.MAX_FAILED
        assert next(iter(d._failed)) == "10.0.0.100:9" and f"10.0.{(n - 1) // 256}.{(n - 1) % 256}:9" in d._failed
        assert d._backoff("10.0.0.100:9") == 60.0  # still remembered: its second failure


def test_kv_drop_meta_is_bounded_and_checked():
    cfg = ProtocolConfig()
    assert KvDrop.parse(7, MetaReader(KvDrop(7, "req-1").meta()), cfg) == KvDrop(7, "req-1")
    for bad in (MetaWriter().text("").getvalue(), MetaWriter().blob(b"\xff\xfe").getvalue()):
        with pytest.raises(ProtocolError) as info:
            KvDrop.parse(7, MetaReader(bad), cfg)
        assert info.value.fault is ProtocolFault.MALFORMED
