"""gRPC-specific registry behaviour: outages degrade lookups, bad input is refused; benchmark."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tiersync.net.registry.base import RegistryConfig, StoreInfo
from tiersync.net.registry.errors import RegistryUnavailableError
from tiersync.net.registry.memory import MemoryRegistry

grpc = pytest.importorskip("grpc")
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
