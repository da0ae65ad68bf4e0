"""Two hosts in network namespaces: a real `tiersync store-node` in one, a client in the other.

The namespaces are joined only by a veth pair (10.77.0.1 <-> 10.77.0.2), so every byte the
test checks crossed that link, not loopback; the veth counters confirm it. Needs root and
iproute2 (``ip``); otherwise, or when the kernel refuses to create namespaces (a container
without CAP_SYS_ADMIN), the test is skipped and the reason printed. The namespaces (and with
them the veth pair) are deleted in a finalizer, also when the test fails.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from _peer import Proc, wait_until

NODE_IP, CLIENT_IP = "10.77.0.1", "10.77.0.2"
TOKEN = "netns-test-token-0123456789abcdef"
BLOCK = 256 << 10

CLIENT = r"""
import hashlib, json, os, sys
from tiersync.net.store_node import StoreNodeClient
address, token, n, block = sys.argv[1], sys.argv[2].encode(), int(sys.argv[3]), int(sys.argv[4])
keys = [b"N" + i.to_bytes(15, "little") for i in range(n)]
bufs = [os.urandom(block - 13 * i) for i in range(n)]
client = StoreNodeClient(address, token=token, timeout=30.0, bind_host=sys.argv[5])
pushed = client.offer_and_push(keys, bufs)  # OFFER; the node PULLs from us over the veth; COMMIT
into = [bytearray(block) for _ in keys]
sizes = client.read(keys, into)  # READ_LEASE, pipelined PULLs, RELEASE -> COMMITTED
print(json.dumps({"offer": pushed.offer.name, "commit": pushed.commit.name,
                  "exact": [bytes(b[:s]) for b, s in zip(into, sizes)] == bufs,
                  "bytes": sum(sizes), "sha": hashlib.sha256(b"".join(bufs)).hexdigest()}), flush=True)
"""


def _skip(request: pytest.FixtureRequest, reason: str) -> None:
    """Skip, printing the reason on the terminal (pytest's output capture would swallow a print)."""
    capture = request.config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        with capture.global_and_fixture_disabled():
            print(f"\ntest_netns skipped: {reason}", flush=True)
    pytest.skip(reason)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _tx_rx(ns: str, dev: str) -> tuple[int, int]:
    out = subprocess.run(
        ["ip", "-n", ns, "-j", "-s", "link", "show", dev], check=True, capture_output=True, text=True, timeout=30
    ).stdout
    stats = json.loads(out)[0]["stats64"]
    return stats["tx"]["bytes"], stats["rx"]["bytes"]


@pytest.fixture
def two_hosts(request):
    """(node namespace, client namespace, client veth) joined by one veth pair; deleted afterwards."""
    if os.geteuid() != 0:
        _skip(request, "needs root to create network namespaces")
    if shutil.which("ip") is None:
        _skip(request, "iproute2 ('ip') is not installed")
    tag = f"{os.getpid() % 100000}"
    node_ns, client_ns, node_if, client_if = f"tsnode{tag}", f"tsclient{tag}", f"tsa{tag}", f"tsb{tag}"
    made: list[str] = []
    try:
        for ns in (node_ns, client_ns):
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("link", "add", node_if, "netns", node_ns, "type", "veth", "peer", "name", client_if, "netns", client_ns)
        for ns, dev, addr in ((node_ns, node_if, NODE_IP), (client_ns, client_if, CLIENT_IP)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, OSError) as exc:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True, timeout=30)
        detail = getattr(exc, "stderr", "") or str(exc)
        _skip(request, f"cannot create network namespaces here: {detail.strip()}")
    try:
        yield node_ns, client_ns, client_if
    finally:
        for ns in made:  # deleting a namespace also removes its end of the veth pair
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True, timeout=30)


def test_store_node_write_and_leased_read_across_a_veth_link(two_hosts):
    node_ns, client_ns, client_if = two_hosts
    node = Proc(
        [
            "ip",
            "netns",
            "exec",
            node_ns,
            sys.executable,
            "-m",
            "tiersync.cli",
            "store-node",
            "--capacity",
            "16MiB",
            "--port",
            "0",
            "--host",
            NODE_IP,
            "--block-size",
            str(BLOCK),
            "--token",
            TOKEN,
        ],
        "listening on ",
    )
    try:
        address = node.address_after("listening on ")
        assert address.startswith(NODE_IP + ":")
        tx0, rx0 = _tx_rx(client_ns, client_if)
        n = 24
        run = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                client_ns,
                sys.executable,
                "-c",
                CLIENT,
                address,
                TOKEN,
                str(n),
                str(BLOCK),
                CLIENT_IP,
            ],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        result = json.loads(run.stdout.strip().splitlines()[-1])
        assert result["offer"] == "ACCEPT" and result["commit"] == "COMMITTED" and result["exact"] is True
        total = sum(BLOCK - 13 * i for i in range(n))
        assert result["bytes"] == total
        tx1, rx1 = _tx_rx(client_ns, client_if)
        assert tx1 - tx0 >= total and rx1 - rx0 >= total  # pushed out and read back over the veth link
    finally:
        node.kill()


SERVER = r"""
import sys, threading
from tiersync.net import events as ev
from tiersync.net.source import MemoryBlockSource
from tiersync.net.tcp import TcpConfig, TcpTransport
asked, answer = threading.Event(), threading.Event()
class HeldPings(MemoryBlockSource):  # a PING is answered only on the "answer" command
    def handle(self, session, event):
        if isinstance(event, ev.Ping):
            asked.set()
            answer.wait(60)
        return super().handle(session, event)
config = TcpConfig(token=sys.argv[2], keepalive_s=float(sys.argv[3]))
server = TcpTransport(config).serve(sys.argv[1] + ":0", HeldPings({}))
print("listening on", server.address, flush=True)
for line in sys.stdin:  # "answer": answer the held PING; anything else: the state
    if line.strip() == "answer":
        answer.set()
    print("connections", server.connections, "asked", int(asked.is_set()), flush=True)
"""

IDLE_CLIENT = r"""
import sys, threading, time
from tiersync.net import events as ev
from tiersync.net.tcp import TcpConfig, TcpTransport
channel = TcpTransport(TcpConfig(token=sys.argv[2], keepalive_s=0)).connect(sys.argv[1])
if sys.argv[3] == "ping":  # a request whose answer comes only after the link went down
    threading.Thread(target=lambda: channel.request(ev.Ping(channel.new_request_id()), timeout=120), daemon=True).start()
print("connected", flush=True)
time.sleep(120)
"""


def _state(server: subprocess.Popen, command: str = "?") -> tuple[int, int]:
    """(open connections, whether a PING is held) of the server, after ``command``."""
    server.stdin.write(command + "\n")
    server.stdin.flush()
    words = server.stdout.readline().split()
    return int(words[1]), int(words[3])


def _connections(server: subprocess.Popen) -> int:
    return _state(server)[0]


def _unacked(ns: str) -> int:
    """Bytes the established TCP connections in ``ns`` sent and have not had acknowledged."""
    out = subprocess.run(
        ["ip", "netns", "exec", ns, "ss", "-tnH", "state", "established"],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    return sum(int(line.split()[1]) for line in out.splitlines() if line.strip())


@pytest.mark.parametrize(
    "keepalive_s,pending", [(2.0, False), (2.0, True), (0.0, False)], ids=["idle", "answer-in-flight", "none"]
)
def test_an_idle_session_of_a_peer_cut_off_is_closed_by_keepalive(two_hosts, keepalive_s, pending):
    """An authenticated client sits idle; then its link goes down (its host lost power, a
    partition: no FIN, no RST ever comes). With keepalive (2 s here) the server closes the
    session within seconds; without keepalive the session holds its slot for good.
    ``answer-in-flight``: the server answers a request after the link went down, so its bytes
    stay unacknowledged, and then retransmissions, not keepalive probes, run (about 15
    minutes): the send timeout (TCP_USER_TIMEOUT) closes it."""
    node_ns, client_ns, client_if = two_hosts
    run = ["ip", "netns", "exec"]
    server = subprocess.Popen(
        [*run, node_ns, sys.executable, "-c", SERVER, NODE_IP, TOKEN, str(keepalive_s)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    client = None
    try:
        address = server.stdout.readline().split()[-1]
        mode = "ping" if pending else "idle"
        client = subprocess.Popen(
            [*run, client_ns, sys.executable, "-c", IDLE_CLIENT, address, TOKEN, mode],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert client.stdout.readline().strip() == "connected"
        assert wait_until(lambda: _state(server) == (1, int(pending)), 10)
        assert wait_until(lambda: _unacked(node_ns) == 0, 10)  # all the server sent so far was acked
        subprocess.run(["ip", "-n", client_ns, "link", "set", client_if, "down"], check=True, timeout=30)
        if pending:
            _state(server, "answer")
            assert wait_until(lambda: _unacked(node_ns) > 0, 10)  # the answer, never acknowledged
        closed = wait_until(lambda: _connections(server) == 0, 15)
        assert closed is (keepalive_s > 0)
    finally:
        for p in (client, server):
            if p is not None:
                p.kill()
                p.wait(10)
