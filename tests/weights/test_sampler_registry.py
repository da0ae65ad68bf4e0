"""The publisher's sampler registry against a peer speaking the control ops by hand: one
sampler per connection, and a sampler's answers kept for recent versions only."""

from __future__ import annotations

import time

import pytest

from _sync_helpers import fsdp, model
from tiersync.errors import ClosedError
from tiersync.net.config import TcpConfig
from tiersync.net.errors import PeerClosedError, RequestError
from tiersync.net.tcp import TcpTransport
from tiersync.weights.config import PublisherConfig, SyncStatus, TransportKind
from tiersync.weights.ops import WEIGHTS, Ack, Announce, Register, Welcome
from tiersync.weights.publisher import WeightPublisher
from tiersync.weights.sampler_registry import _KEPT_ACKS

TOKEN = "registry-token-of-32-characters!"


def _until(predicate, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.fixture()
def publisher():
    pub = WeightPublisher(model(3), fsdp(1), config=PublisherConfig(token=TOKEN, shm=False))
    yield pub
    pub.close()


def _register(channel, rank: int, label: str) -> object:
    return channel.request(Register(channel.new_request_id(), label, rank, "elsewhere", TransportKind.TCP))


def test_a_connection_registers_one_sampler_and_its_end_drops_it(publisher):
    channel = TcpTransport(TcpConfig(token=TOKEN), WEIGHTS).connect(publisher.address)
    try:
        assert isinstance(_register(channel, 0, "a"), Welcome)
        with pytest.raises(RequestError, match="registered already"):
            _register(channel, 1, "b")  # before: a second sampler on the same session stayed after it ended
        assert publisher.samplers() == {"a": 0}
    finally:
        channel.close()
    assert _until(lambda: publisher.samplers() == {})


def test_samplers_of_one_rank_under_other_labels_all_stay_and_a_label_registered_again_replaces(publisher):
    """The same worker of two engines (rank 0 of each) both take part, and so does a sampler of
    another rank under one of their labels; a sampler that comes back under its label and rank
    replaces its old registration, whose connection is closed. Before, the
    registry kept one sampler per rank: the second engine's worker dropped the first's."""
    connect = TcpTransport(TcpConfig(token=TOKEN), WEIGHTS).connect
    a, b, other_rank, again = (connect(publisher.address) for _ in range(4))
    try:
        assert isinstance(_register(a, 0, "engine-a-0"), Welcome)
        assert isinstance(_register(b, 0, "engine-b-0"), Welcome)
        assert isinstance(_register(other_rank, 1, "engine-a-0"), Welcome)  # one label, another rank
        assert _until(lambda: len(publisher._registry.live()) == 3)
        assert sorted(publisher.samplers()) == ["engine-a-0", "engine-b-0"]  # a label listed once
        assert isinstance(_register(again, 0, "engine-a-0"), Welcome)
        assert _until(lambda: _gone(a))  # the old registration's connection ends
        assert len(publisher._registry.live()) == 3  # white box: the old one is no target
        assert not _gone(b) and not _gone(other_rank)
    finally:
        for c in (a, b, other_rank, again):
            c.close()


def _gone(channel) -> bool:
    """The publisher closed ``channel``'s connection (a request on it finds it closed; a
    connection still open answers that it registered already)."""
    try:
        _register(channel, 0, "probe")
    except RequestError:
        return False
    except (PeerClosedError, ClosedError):
        return True
    return False


def test_a_samplers_answers_are_kept_for_recent_versions_only(publisher):
    channel = TcpTransport(TcpConfig(token=TOKEN), WEIGHTS).connect(publisher.address)
    try:
        assert isinstance(_register(channel, 0, "a"), Welcome)
        channel.send_many([Ack(v, True) for v in range(1, 201)])  # answers nobody asked for
        publisher.wait_for_samplers(1, 10)  # WELCOME is written before the sampler takes part
        sampler = publisher._registry.live()[0]  # white box: how many answers it holds
        assert _until(lambda: 200 in sampler.acks)
        assert sorted(sampler.acks) == list(range(201 - _KEPT_ACKS, 201))
    finally:
        channel.close()


@pytest.mark.parametrize(
    ("peer", "granted"),
    [("127.0.0.1:5000", True), ("[::1]:5000", True), ("198.51.100.7:5000", False), ("not an address", False)],
)
def test_shared_memory_needs_a_connection_from_this_host(peer, granted):
    """A sampler's host id is in every manifest, so a remote one could repeat it: shared memory
    (and zero-copy holds on /dev/shm) also needs its connection to come from this host."""
    from types import SimpleNamespace

    from tiersync.weights.sampler_registry import _from_this_host

    assert _from_this_host(SimpleNamespace(peer=peer)) is granted


def test_a_relay_that_is_no_host_port_is_refused_at_the_boundary():
    """Every sampler's relay goes into every manifest: only '' or a short ASCII host:port."""
    from tiersync.errors import UsageError

    for relay in ("\x01" * 1024, "a" * 300 + ":1", "host:70000", "host:", ":5000", "h\u00e9:1", "host:\u00b2"):
        with pytest.raises(UsageError) as info:
            Register(1, "s", 0, "h", TransportKind.TCP, relay)
        assert info.value.argument == "relay", relay
    for relay in ("", "10.0.0.1:5000", "::1:5000", "sampler-3.example:42"):
        Register(1, "s", 0, "h", TransportKind.TCP, relay)


def test_a_manifest_too_large_to_send_fails_the_publish_not_the_samplers(tmp_path):
    """An ANNOUNCE this side cannot encode (the manifest of 400 long-named tensors over the
    publisher's max_meta_bytes) fails that publish with the UsageError; the sampler stays
    registered. Before, each sampler was dropped for it, for good."""
    import numpy as np

    from tiersync.errors import UsageError
    from tiersync.weights.config import ReceiverConfig
    from tiersync.weights.receiver import WeightReceiver

    tensors = {f"layer.{i:04d}." + "w" * 100: np.zeros(4, np.float32) for i in range(400)}
    config = PublisherConfig(max_meta_bytes=32 << 10, shm_dir=str(tmp_path))
    pub = WeightPublisher(tensors, fsdp(1), config=config)
    rec = WeightReceiver(fsdp(1), ReceiverConfig((pub.address,), zero_copy=True))
    try:
        pub.wait_for_samplers(1, 30)
        with pytest.raises(UsageError, match="max_meta_bytes"):
            pub.publish(1).result(30)
        pub.wait_for_samplers(1, 1)  # still registered (a dropped sampler never comes back)
        assert pub._buffer._pool.held() == 0  # and the zero-copy sampler holds no segment it never heard of
    finally:
        rec.close()
        pub.close()


def test_a_label_that_is_too_long_or_not_printable_is_refused_at_the_boundary():
    from tiersync.errors import UsageError
    from tiersync.weights.config import ReceiverConfig

    for bad in ("x" * 256, "a\nb", ""):
        with pytest.raises(UsageError) as exc:
            Register(1, bad, 0, "host", TransportKind.TCP)
        assert exc.value.argument == "label"
        with pytest.raises(UsageError) as exc:
            ReceiverConfig(("127.0.0.1:1",), sampler_id=bad)
        assert exc.value.argument == "sampler_id"


def test_close_ends_a_publish_waiting_for_a_silent_sampler_and_cancels_the_queued_ones():
    """A sampler that registered and never answers: close() does not wait out the running
    publish's publish_timeout_s (nor run the queued ones); the running one's result says the
    sampler did not answer, the queued one is cancelled, and a publish after close is refused."""
    import threading
    from concurrent.futures import CancelledError

    pub = WeightPublisher(model(3), fsdp(1), config=PublisherConfig(token=TOKEN, shm=False, publish_timeout_s=600))
    channel = TcpTransport(TcpConfig(token=TOKEN), WEIGHTS).connect(pub.address)
    try:
        assert isinstance(_register(channel, 0, "silent"), Welcome)
        pub.wait_for_samplers(1, 30)  # it takes part once its W_WELCOME was written
        running, queued = pub.publish(1), pub.publish(2)
        announced = channel.receive(timeout=30)  # publish 1 runs (else close would cancel it too)
        assert isinstance(announced, Announce) and announced.manifest.version == 1
        closer = threading.Thread(target=pub.close)
        closer.start()
        closer.join(60)  # before: 600 s per publish
        assert not closer.is_alive()
        assert [(o.sampler, o.status) for o in running.result(10).outcomes] == [("silent", SyncStatus.TIMEOUT)]
        with pytest.raises(CancelledError):
            queued.result(10)
        with pytest.raises(ClosedError):
            pub.publish(3)
    finally:
        channel.close()
        pub.close()
