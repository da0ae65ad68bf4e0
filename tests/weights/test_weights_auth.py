"""Every weight-sync link is authenticated: the shared token on control, data and relay
connections, TLS end to end (relays included), and tokens refused at the config boundary."""

from __future__ import annotations

import logging
import os
import sys

import pytest

from _sync_helpers import assert_bitwise, fsdp, model
from tiersync.errors import UsageError
from tiersync.net.config import TcpConfig
from tiersync.net.errors import AuthError, PeerClosedError
from tiersync.net.tcp import TcpTransport
from tiersync.net.tls import TlsConfig
from tiersync.weights import Mesh, Sharding
from tiersync.weights.config import PublisherConfig, ReceiverConfig, TransportKind
from tiersync.weights.ops import WEIGHTS
from tiersync.weights.publisher import WeightPublisher
from tiersync.weights.receiver import WeightReceiver

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "net"))

TOKEN = "weights-token-of-32-characters!!"
TIMEOUT = 60


def _sync(pub, recs, version, g, layout):
    assert pub.publish(version).result(TIMEOUT).ok
    for rank, rec in enumerate(recs):
        rec.receive(version).result(TIMEOUT)
        with rec.acquire(TIMEOUT) as lease:
            assert lease.version == version
            assert_bitwise(lease.tensors, g, layout, rank)


@pytest.mark.parametrize("token", [None, "another-token-of-32-characters!!"])
def test_a_receiver_without_the_token_is_refused_and_logged_while_others_are_served(token, caplog):
    g = model(11)
    pub = WeightPublisher(g, fsdp(1), config=PublisherConfig(token=TOKEN))
    good = WeightReceiver(fsdp(1), ReceiverConfig((pub.address,), token=TOKEN.encode(), transport=TransportKind.TCP))
    try:
        pub.wait_for_samplers(1, TIMEOUT)
        with caplog.at_level(logging.WARNING, logger="tiersync.net.server"):
            with pytest.raises(AuthError) as info:
                WeightReceiver(fsdp(1), ReceiverConfig((pub.address,), rank=1, token=token))
            assert info.value.peer == pub.address
            with pytest.raises(AuthError):  # a data connection is no way around it
                TcpTransport(TcpConfig(token=token), WEIGHTS).connect(pub.address)
            _sync(pub, [good], 1, g, fsdp(1))  # the authorized sampler is still served
        refusals = [r for r in caplog.records if "refused" in r.getMessage() and pub.address in r.getMessage()]
        assert len(refusals) >= 2, [r.getMessage() for r in caplog.records]
        assert list(pub.samplers().values()) == [0] and next(iter(pub.samplers())).startswith("sampler-0@")
    finally:
        good.close()
        pub.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    pytest.importorskip("cryptography")
    from _certs import make_pki

    return make_pki(tmp_path_factory.mktemp("pki"), "trainer", "sampler")


def test_publish_over_tls_with_relays_is_bitwise(pki):
    """Mutual TLS and the token on every link, TCP forced, fanout 1: the second sampler's
    chunks come through the first one's relay server, over TLS too."""
    g = model(12)
    layout = Sharding.replicated(Mesh((3,), ("dp",)))
    cert, key = pki["trainer"]
    pub = WeightPublisher(
        g,
        fsdp(1),
        config=PublisherConfig(
            token=TOKEN, tls=TlsConfig(pki["ca"], cert, key, require_peer_cert=True), fanout=1, segment_bytes=512
        ),
    )
    scert, skey = pki["sampler"]
    tls = TlsConfig(pki["ca"], scert, skey, require_peer_cert=True)
    recs = [
        WeightReceiver(
            layout, ReceiverConfig((pub.address,), rank=r, token=TOKEN, tls=tls, transport=TransportKind.TCP)
        )
        for r in range(3)
    ]
    try:
        pub.wait_for_samplers(3, TIMEOUT)
        for version in (1, 2):
            g["embed"][0, 0] = version
            _sync(pub, recs, version, g, layout)
        assert all(r.transports() == (TransportKind.TCP,) for r in recs)
        assert sum(r.stats()["relay"] for r in recs) > 0  # relays ran, authenticated and encrypted
        with pytest.raises((AuthError, PeerClosedError)):  # TLS is not optional there (the server ends it)
            WeightReceiver(layout, ReceiverConfig((pub.address,), rank=0, token=TOKEN, connect_timeout_s=5))
    finally:
        for x in (*recs, pub):
            x.close()


def test_a_tls_receiver_without_a_certificate_serves_no_relays(pki):
    g = model(13)
    cert, key = pki["trainer"]
    pub = WeightPublisher(
        g, fsdp(1), config=PublisherConfig(tls=TlsConfig(pki["ca"], cert, key), fanout=1, segment_bytes=512)
    )
    layout = Sharding.replicated(Mesh((2,), ("dp",)))
    recs = [WeightReceiver(layout, ReceiverConfig((pub.address,), rank=r, tls=TlsConfig(pki["ca"]))) for r in range(2)]
    try:
        pub.wait_for_samplers(2, TIMEOUT)
        _sync(pub, recs, 1, g, layout)  # the chunks it would relay come from the trainer instead
        assert all(r.stats()["relay"] == 0 for r in recs) and not recs[0].config.relays
    finally:
        for x in (*recs, pub):
            x.close()


@pytest.mark.parametrize("cls, args", [(PublisherConfig, {}), (ReceiverConfig, {"publishers": ("h:1",)})])
@pytest.mark.parametrize(
    "bad, argument", [("short", "token"), (b"x" * 15, "token"), (42, "token"), ({"cafile": "ca"}, "tls")]
)
def test_tokens_and_tls_are_checked_at_the_config_boundary(cls, args, bad, argument):
    field = "tls" if argument == "tls" else "token"
    with pytest.raises(UsageError) as exc:
        cls(**args, **{field: bad})
    assert exc.value.argument == argument and "short" not in str(exc.value)  # the value is never echoed
    ok = cls(**args, token="s" * 16)
    assert ok.token == b"s" * 16 and ok.tcp_config(*(["n"] if cls is PublisherConfig else [])).token == b"s" * 16
