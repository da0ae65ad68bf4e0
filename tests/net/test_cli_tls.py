"""`tiersync store-node` and `tiersync registry` over TLS from their flags (tiersync.cli_tls):
real processes, real certificates, mutual TLS and the token on every link."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from _peer import TOKEN, RegistryProc, wait_until
from _peer import StoreNodeProc as Node
from tiersync.errors import RemoteError
from tiersync.net import events as ev
from tiersync.net.registry import open_registry
from tiersync.net.registry.base import RegistryConfig
from tiersync.net.store_node import StoreNodeClient
from tiersync.net.tls import TlsConfig


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    from _certs import make_pki

    return make_pki(tmp_path_factory.mktemp("pki"), "registry", "node", "writer")


def _flags(pki, leaf: str) -> tuple[str, ...]:
    cert, key = pki[leaf]
    return ("--tls-cert", cert, "--tls-key", key, "--tls-ca", pki["ca"], "--tls-require-client-cert")


def test_a_store_node_registered_in_a_registry_serves_mutual_tls_from_its_flags(pki, tmp_path):
    """The registry and the node start with TLS flags (their lines say so); a writer with a
    certificate pushes blocks (the node dials it back over TLS) and reads them back byte-exact;
    the node registered and announced them through the registry's TLS port; a plaintext client
    and one without a certificate are refused, by the node and by the registry alike."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    registry = RegistryProc(token_file=str(token_file), extra=_flags(pki, "registry"))
    node = None
    try:
        assert "mutual TLS" in registry.line
        node = Node(registry=registry.address, store_id="n1", heartbeat_s=1.0, extra=_flags(pki, "node"))
        assert "mutual TLS" in node.line and "registered as n1" in node.line
        writer = TlsConfig(pki["ca"], *pki["writer"])
        keys, blocks = [bytes([i]) * 16 for i in range(3)], [os.urandom(100 << 10) for _ in range(3)]
        client = StoreNodeClient(node.address, token=TOKEN, tls=writer, timeout=20)
        assert client.offer_and_push(keys, blocks).commit is ev.CommitStatus.COMMITTED
        out = [bytearray(len(b)) for b in blocks]
        assert client.read(keys, out) == [len(b) for b in blocks] and out == blocks
        for tls in (None, TlsConfig(pki["ca"])):  # plaintext; TLS without a client certificate
            with pytest.raises(RemoteError):
                StoreNodeClient(node.address, token=TOKEN, tls=tls, timeout=5).read(keys[:1], [bytearray(1 << 20)])
        seen = open_registry(registry.address, RegistryConfig(rpc_timeout_s=5.0, token=TOKEN, tls=writer))
        assert wait_until(lambda: seen.lookup(keys) == [("n1",)] * 3, timeout=30)
        seen.close()
        for config in (
            RegistryConfig(rpc_timeout_s=2.0, token=TOKEN),
            RegistryConfig(rpc_timeout_s=2.0, token=TOKEN, tls=TlsConfig(pki["ca"])),
        ):
            blind = open_registry(registry.address, config)
            assert blind.lookup(keys) == [(), (), ()]  # refused: the lookup degrades to "nowhere"
            blind.close()
    finally:
        if node is not None:
            node.kill()
        registry.kill()


@pytest.mark.parametrize("command", [["registry", "--port", "0"], ["store-node", "--capacity", "4MiB", "--port", "0"]])
def test_tls_flags_are_checked_before_anything_starts_naming_the_flag(command, pki, tmp_path):
    """Missing partners, an unreadable file, a certificate or CA that is not PEM, mutual TLS
    without certificates: each exit 2 with one line naming the flag, nothing started."""
    junk, fifo = tmp_path / "junk.pem", tmp_path / "fifo"
    junk.write_text("not a certificate")
    os.mkfifo(fifo)
    cert, key = pki["node"]
    cases = [
        (["--tls-cert", cert], "--tls-key"),
        (["--tls-cert", cert, "--tls-key", key], "--tls-ca"),
        (["--tls-cert", cert, "--tls-key", key, "--tls-ca", str(tmp_path / "missing.pem")], "--tls-ca"),
        (["--tls-cert", str(junk), "--tls-key", key, "--tls-ca", pki["ca"]], "--tls-cert"),
        (["--tls-cert", cert, "--tls-key", key, "--tls-ca", str(junk)], "--tls-ca"),
        (["--tls-cert", cert, "--tls-key", str(junk), "--tls-ca", pki["ca"]], "--tls-key"),
        (["--tls-cert", cert, "--tls-key", pki["writer"][1], "--tls-ca", pki["ca"]], "--tls-key"),  # another's
        (["--tls-cert", cert, "--tls-key", key, "--tls-ca", str(fifo)], "--tls-ca"),  # never opened blocking
        (["--tls-require-client-cert"], "--tls-require-client-cert"),
    ]
    for flags, named in cases:
        _refused([*command, *flags], named)


def _refused(args: list[str], named: str, env: dict[str, str] | None = None) -> None:
    """``tiersync ARGS`` exits 2, no traceback, its last line naming ``named``; nothing started."""
    env = {**{k: v for k, v in os.environ.items() if k != "TIERSYNC_TOKEN"}, **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "tiersync.cli", *args], capture_output=True, text=True, timeout=60, env=env, check=False
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"tiersync {args[0]}: {named}"), (args, proc.stderr)
    assert "listening" not in proc.stdout


def test_a_store_node_takes_its_tls_settings_from_its_variables(pki):
    """TIERSYNC_STORE_NODE_TLS_* like every store-node flag: mutual TLS from a variable (the
    start line says so), and a bad value names the variable."""
    cert, key = pki["node"]
    env = {"TIERSYNC_STORE_NODE_TLS_CERT": cert, "TIERSYNC_STORE_NODE_TLS_KEY": key}
    env |= {"TIERSYNC_STORE_NODE_TLS_CA": pki["ca"], "TIERSYNC_STORE_NODE_TLS_REQUIRE_CLIENT_CERT": "true"}
    node = subprocess.Popen(
        [sys.executable, "-m", "tiersync.cli", "store-node", "--capacity", "4MiB", "--port", "0", "--token", TOKEN],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **env},
    )
    try:
        assert "mutual TLS" in node.stdout.readline()
    finally:
        node.kill()
        node.wait(10)
    store_node = ["store-node", "--capacity", "4MiB", "--port", "0", "--token", TOKEN]
    mutual = "TIERSYNC_STORE_NODE_TLS_REQUIRE_CLIENT_CERT"
    _refused(store_node, mutual, env | {mutual: "maybe"})
    _refused(store_node, "TIERSYNC_STORE_NODE_TLS_KEY", env | {"TIERSYNC_STORE_NODE_TLS_KEY": "/missing.key"})
