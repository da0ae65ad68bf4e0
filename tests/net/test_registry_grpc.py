"""gRPC-specific registry behaviour: outages degrade lookups, bad input is refused; benchmark."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tiersync.net.registry.base import RegistryConfig, StoreInfo
from tiersync.net.registry.errors import RegistryUnavailableError
from tiersync.net.registry.memory import MemoryRegistry

grpc = pytest.importorskip("grpc")
from tiersync.net.registry.auth import METADATA_KEY, proof  # noqa: E402
from tiersync.net.registry.grpc_service import SERVICE, RegistryClient, serve_registry  # noqa: E402

FAST = RegistryConfig(rpc_timeout_s=0.5)
KEYS = [i.to_bytes(16, "little") for i in range(300)]


def test_outage_shortens_lookup_answers_and_never_raises():
    backend = MemoryRegistry()
    backend.register_store(StoreInfo("a", "127.0.0.1:1", 10, "g"))
    backend.publish("a", KEYS)
    server = serve_registry(backend)
    client = RegistryClient(server.address, FAST)
    assert client.lookup(KEYS) == [("a",)] * 300
    server.stop()
    assert client.lookup(KEYS) == [()] * 300
    assert client.placement_targets("g", 3) == []
    assert client.failures == 2
    with pytest.raises(RegistryUnavailableError) as info:
        client.publish("a", KEYS[:1])
    assert info.value.peer == server.address
    client.close()


def test_a_registry_of_another_message_version_is_named_as_such_and_lookups_degrade():
    """The schema version is in the service name: a server of another version (here the
    unversioned name of earlier releases) never parses this client's bytes; the client says
    why, and lookups degrade as on an outage."""
    seen: list[bytes] = []
    old = grpc.server(ThreadPoolExecutor(max_workers=2))
    handlers = {
        n: grpc.unary_unary_rpc_method_handler(lambda req, ctx: seen.append(req) or b"") for n in ("Lookup", "Publish")
    }
    old.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("tiersync.Registry", handlers),))
    address = f"127.0.0.1:{old.add_insecure_port('127.0.0.1:0')}"
    old.start()
    client = RegistryClient(address, FAST)
    try:
        with pytest.raises(RegistryUnavailableError, match="another tiersync version") as info:
            client.publish("a", KEYS[:1])
        assert SERVICE in str(info.value) and info.value.peer == address
        assert client.lookup(KEYS[:3]) == [()] * 3 and client.failures == 1
        assert not seen  # the old server never read a byte of it
    finally:
        client.close()
        old.stop(None)


def test_malformed_message_is_invalid_argument():
    server = serve_registry(MemoryRegistry())
    channel = grpc.insecure_channel(server.address)
    try:
        call = channel.unary_unary(f"/{SERVICE}/Lookup")
        with pytest.raises(grpc.RpcError) as info:
            call(b"\xff\xff\xff\xff", timeout=2)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    finally:
        channel.close()
        server.stop()


def test_a_register_call_carries_exactly_one_store():
    """RegistryClient sends one record a call; a call carrying several (up to 65,536 fitted in
    one message, each then read by every lookup) is refused and registers none of them."""
    from tiersync.net.registry import messages as m

    backend = MemoryRegistry()
    server = serve_registry(backend)
    channel = grpc.insecure_channel(server.address)
    try:
        call = channel.unary_unary(f"/{SERVICE}/RegisterStore")
        two = [StoreInfo("a", "127.0.0.1:1", 10, "g"), StoreInfo("b", "127.0.0.1:2", 10, "g")]
        for infos in (two, []):
            with pytest.raises(grpc.RpcError) as info:
                call(m.enc_infos(infos), timeout=2)
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "carries one store" in info.value.details()
        assert backend.get_store("a") is None and backend.get_store("b") is None
        call(m.enc_infos(two[:1]), timeout=2)
        assert backend.get_store("a") is not None
    finally:
        channel.close()
        server.stop()


def test_bench_registry_embedded_and_grpc():
    from tiersync.net.registry.bench import bench_registry

    local = bench_registry(n_keys=20_000, batches=200)
    remote = bench_registry(n_keys=20_000, batches=40, via_grpc=True)
    print(f"embedded: {local}\ngrpc: {remote}")
    assert set(local) == {"lookups_per_s", "p50_ms", "p99_ms"}
    assert local["lookups_per_s"] > 50_000 and local["p50_ms"] <= local["p99_ms"]  # loose: shared CI cores
    assert remote["lookups_per_s"] > 1_000


def test_importing_tiersync_net_stays_cheap():
    code = (
        "import sys, tiersync, tiersync.net, tiersync.net.registry, tiersync.net.protocol, tiersync.net.tcp;"
        "bad = [m for m in ('grpc', 'redis', 'cryptography') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_backend_outage_is_unavailable_over_grpc_and_degrades_the_client():
    class Down(MemoryRegistry):
        def heartbeat(self, store_id, free_blocks):
            raise RegistryUnavailableError("redis failed: connection refused", peer="redis://x")

    server = serve_registry(Down())
    channel = grpc.insecure_channel(server.address)
    client = RegistryClient(server.address, FAST)
    try:
        from tiersync.net.registry import messages as m

        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary(f"/{SERVICE}/Heartbeat")(m.enc_heartbeat("a", 1), timeout=2)
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE  # retryable, not the caller's fault
        with pytest.raises(RegistryUnavailableError):
            client.heartbeat("a", 1)
    finally:
        client.close()
        channel.close()
        server.stop()


def test_open_registry_picks_the_backend():
    from tiersync.errors import UsageError
    from tiersync.net.registry import open_registry

    client = open_registry("127.0.0.1:1", FAST)
    assert isinstance(client, RegistryClient) and client.lookup(KEYS[:2]) == [(), ()]
    client.close()
    with pytest.raises(UsageError):
        open_registry("not an address")
    from tiersync.net.tls import TlsConfig

    with pytest.raises(UsageError, match="rediss://"):  # Redis takes TLS from its URL: a tls config would be ignored
        open_registry("redis://127.0.0.1:1/0", RegistryConfig(tls=TlsConfig("/nonexistent/ca.pem")))


# -- the token: every call proves it when the server has one ------------------------------------
TOKEN = b"registry-secret-0123456789"


@pytest.fixture()
def guarded():
    backend = MemoryRegistry()
    server = serve_registry(backend, token=TOKEN)
    yield backend, server
    server.stop()


def _client(server, token):
    return RegistryClient(server.address, RegistryConfig(rpc_timeout_s=2.0, token=token))


@pytest.mark.parametrize("token", [None, b"another-secret-0123456789"], ids=["none", "wrong"])
def test_a_client_without_the_token_changes_nothing(guarded, token):
    from tiersync.net.errors import AuthError

    backend, server = guarded
    client = _client(server, token)
    try:
        with pytest.raises(AuthError) as info:
            client.register_store(StoreInfo("evil", "127.0.0.1:1", 10**6, "g"))
        assert info.value.peer == server.address
        with pytest.raises(AuthError):
            client.publish("evil", KEYS)
        assert client.lookup(KEYS[:3]) == [()] * 3  # degrades like an outage, counted
        assert client.failures == 1
    finally:
        client.close()
    assert backend.get_store("evil") is None and backend.lookup(KEYS[:3]) == [()] * 3


def test_a_client_with_the_token_is_served(guarded):
    _, server = guarded
    client = _client(server, TOKEN.decode())  # str accepted, as at every config boundary
    try:
        client.register_store(StoreInfo("a", "127.0.0.1:1", 10, "g"))
        client.publish("a", KEYS)
        assert client.lookup(KEYS) == [("a",)] * 300
        assert [s.store_id for s in client.placement_targets("g", 2)] == ["a"]
    finally:
        client.close()


@pytest.mark.parametrize(
    "forge",
    [
        lambda payload: "v1:1:" + "0" * 32 + ":" + "0" * 64,  # garbage signature
        lambda payload: proof(TOKEN, "Publish", payload, now=time.time() - 3600),  # stale
        lambda payload: proof(TOKEN, "Publish", payload + b"x"),  # signs other bytes
        lambda payload: proof(TOKEN, "Unpublish", payload),  # signs another method
        lambda payload: "v1:1:" + "0" * 32 + ":" + "0" * 1000,  # longer than any proof
        lambda payload: proof(TOKEN, "Publish", payload, now=time.time() + 60),  # dated ahead
    ],
    ids=["garbage", "stale", "other-bytes", "other-method", "long", "ahead"],
)
def test_forged_or_replayed_proofs_are_refused(guarded, forge):
    from tiersync.net.registry import messages as m

    backend, server = guarded
    backend.register_store(StoreInfo("a", "127.0.0.1:1", 10, "g"))
    payload = m.enc_store_keys("a", KEYS[:2])
    channel = grpc.insecure_channel(server.address)
    try:
        call = channel.unary_unary(f"/{SERVICE}/Publish")
        with pytest.raises(grpc.RpcError) as info:
            call(payload, timeout=2, metadata=((METADATA_KEY, forge(payload)),))
        assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
        call(payload, timeout=2, metadata=((METADATA_KEY, proof(TOKEN, "Publish", payload)),))  # the real one passes
    finally:
        channel.close()
    assert backend.lookup(KEYS[:3]) == [("a",), ("a",), ()]


def test_a_short_token_is_refused_at_the_boundary():
    from tiersync.errors import UsageError

    with pytest.raises(UsageError, match="token"):
        RegistryConfig(token="short")
    with pytest.raises(UsageError, match="token"):
        serve_registry(MemoryRegistry(), token=b"short")


@pytest.mark.parametrize(
    "value", [None, "", "v1:²:" + "0" * 32 + ":" + "0" * 64, "v1:1:" + "0" * 32 + ":é", "v2:1:2:3"]
)
def test_check_proof_refuses_what_grpc_would_not_even_send(value):
    """Decided without raising anything but AuthError (a str compare of non-ASCII raises TypeError)."""
    from tiersync.net.errors import AuthError
    from tiersync.net.registry.auth import check_proof

    with pytest.raises(AuthError):
        check_proof(TOKEN, "Publish", b"", value, peer="p")


def test_a_recorded_call_replayed_is_refused_and_changes_nothing(guarded):
    """A proof is taken once: the same call sent again (someone recorded it, e.g. a PUBLISH of
    blocks since unpublished) is refused within the time window."""
    from tiersync.net.registry import messages as m

    backend, server = guarded
    backend.register_store(StoreInfo("a", "127.0.0.1:1", 10, "g"))
    payload = m.enc_store_keys("a", KEYS[:2])
    metadata = ((METADATA_KEY, proof(TOKEN, "Publish", payload)),)
    channel = grpc.insecure_channel(server.address)
    try:
        call = channel.unary_unary(f"/{SERVICE}/Publish")
        call(payload, timeout=2, metadata=metadata)
        assert backend.lookup(KEYS[:2]) == [("a",), ("a",)]
        backend.unpublish("a", KEYS[:2])
        with pytest.raises(grpc.RpcError) as info:
            call(payload, timeout=2, metadata=metadata)
        assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED and "replayed" in info.value.details()
    finally:
        channel.close()
    assert backend.lookup(KEYS[:2]) == [(), ()]


def test_a_call_replayed_to_another_registry_on_the_same_redis_is_refused(tmp_path):
    """Two `tiersync registry` processes on one Redis (a second one, or the first restarted): a
    PUBLISH recorded on its way to the first and sent to the second is refused and changes
    nothing, since proofs of calls that change state are taken once in Redis too."""
    from _peer import RedisProc, RegistryProc
    from tiersync.net.registry import messages as m
    from tiersync.net.registry.redis_backend import RedisRegistry

    redis, procs, channels = RedisProc(str(tmp_path)), [], []
    token_file = tmp_path / "token"
    token_file.write_bytes(TOKEN)
    state = RedisRegistry(redis.url)
    try:
        procs += [RegistryProc(redis=redis.url, token_file=str(token_file)) for _ in range(2)]
        state.register_store(StoreInfo("a", "127.0.0.1:1", 10, "g"))
        payload = m.enc_store_keys("a", KEYS[:2])
        metadata = ((METADATA_KEY, proof(TOKEN, "Publish", payload)),)
        channels += [grpc.insecure_channel(p.address) for p in procs]
        channels[0].unary_unary(f"/{SERVICE}/Publish")(payload, timeout=5, metadata=metadata)
        assert state.lookup(KEYS[:2]) == [("a",), ("a",)]
        state.unpublish("a", KEYS[:2])
        with pytest.raises(grpc.RpcError) as info:
            channels[1].unary_unary(f"/{SERVICE}/Publish")(payload, timeout=5, metadata=metadata)
        assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED and "replayed" in info.value.details()
        assert state.lookup(KEYS[:2]) == [(), ()]
    finally:
        for c in channels:
            c.close()
        for p in procs:
            p.kill()
        state.close()
        redis.kill()


def test_replays_keeps_a_bounded_record_and_refuses_what_it_dropped():
    """Past ``cap`` proofs the oldest is dropped and nothing as old is taken any more; proofs
    older than the window leave the record by themselves."""
    from tiersync.net.errors import AuthError
    from tiersync.net.registry.auth import Replays

    replays = Replays(window_s=10, cap=3)
    for i in range(4):
        replays.take(1000 + i, f"n{i}", peer="p", now=1.5)
    for millis, nonce in ((1000, "n0"), (1000, "fresh"), (1003, "n3")):  # dropped, as old as dropped, taken
        with pytest.raises(AuthError, match="replayed"):
            replays.take(millis, nonce, peer="p", now=1.5)
    replays.take(1001, "another", peer="p", now=1.5)  # newer than the dropped one: taken
    replays.take(20_000, "later", peer="p", now=20.0)  # the first ones ran out of the window and were
    replays.take(1003, "n3", peer="p", now=20.0)  # forgotten (check_proof refuses so stale a proof first)


def test_proofs_dated_ahead_cannot_keep_honest_callers_out():
    """A token holder filling the record with proofs dated 290 s ahead used to push its floor
    there, and every honest proof was then refused as replayed for 290 s: proofs dated over
    FUTURE_S ahead are refused before they are recorded; a little skew still passes."""
    from tiersync.net.errors import AuthError
    from tiersync.net.registry.auth import FUTURE_S, Replays, check_proof

    replays, now = Replays(cap=3), time.time()
    for _ in range(4):
        with pytest.raises(AuthError, match="ahead of this server"):
            check_proof(TOKEN, "Publish", b"", proof(TOKEN, "Publish", b"", now=now + 290), peer="p", replays=replays)
    check_proof(TOKEN, "Publish", b"", proof(TOKEN, "Publish", b""), peer="p", replays=replays)  # honest: taken
    skewed = proof(TOKEN, "Publish", b"", now=time.time() + FUTURE_S / 2)
    check_proof(TOKEN, "Publish", b"", skewed, peer="p", replays=replays)


# -- TLS: the registry's calls encrypted, its certificate verified, optionally the client's -------
@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    from _certs import make_pki

    return make_pki(tmp_path_factory.mktemp("pki"), "server", "client")


@pytest.mark.parametrize("mutual", [False, True], ids=["server-cert", "mutual"])
def test_a_registry_over_tls_serves_clients_that_verify_it_and_no_plaintext_one(pki, mutual):
    from tiersync.net.registry.errors import RegistryUnavailableError
    from tiersync.net.tls import TlsConfig

    (cert, key), (ccert, ckey) = pki["server"], pki["client"]
    backend = MemoryRegistry()
    server = serve_registry(backend, token=TOKEN, tls=TlsConfig(pki["ca"], cert, key, require_peer_cert=mutual))
    good = RegistryConfig(rpc_timeout_s=5.0, token=TOKEN, tls=TlsConfig(pki["ca"], ccert, ckey))
    clients = [RegistryClient(server.address, good)]
    try:
        clients[0].register_store(StoreInfo("a", "127.0.0.1:1", 10, "g"))
        clients[0].publish("a", KEYS[:3])
        assert clients[0].lookup(KEYS[:3]) == [("a",)] * 3
        refused = [RegistryConfig(rpc_timeout_s=2.0, token=TOKEN)]  # plaintext to a TLS port
        if mutual:
            refused.append(RegistryConfig(rpc_timeout_s=2.0, token=TOKEN, tls=TlsConfig(pki["ca"])))  # no client cert
        for config in refused:
            clients.append(client := RegistryClient(server.address, config))
            with pytest.raises(RegistryUnavailableError):
                client.register_store(StoreInfo("evil", "127.0.0.1:2", 10, "g"))
            assert client.lookup(KEYS[:3]) == [()] * 3  # degrades, as on an outage
    finally:
        for c in clients:
            c.close()
        server.stop()
    assert backend.get_store("evil") is None


def test_a_tls_registry_with_unreadable_files_is_refused_naming_them(pki, tmp_path):
    from tiersync.errors import UsageError
    from tiersync.net.tls import TlsConfig

    with pytest.raises(UsageError, match="certfile"):
        serve_registry(MemoryRegistry(), tls=TlsConfig(pki["ca"], str(tmp_path / "missing.pem"), pki["server"][1]))
    with pytest.raises(UsageError, match="tls"):
        RegistryConfig(tls="not a TlsConfig")
