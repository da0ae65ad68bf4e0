"""Same-host reads only from the process that holds the connection's far end
(tiersync.net.socket_owner, the client handshake, TcpChannel's LOCAL_REPLY check): real
sockets, real processes, servers that lie about their pid."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from _peer import TOKEN
from tiersync.net.config import Route
from tiersync.net.errors import ProtocolError, ProtocolFault
from tiersync.net.local import LocalReadError
from tiersync.net.socket_owner import holds_peer_end
from tiersync.net.tcp import TcpConfig, TcpTransport

_HOLDER = """
import socket, sys
L = socket.create_server(("127.0.0.1", 0))
print(L.getsockname()[1], flush=True)
s, _ = L.accept()
s.sendall(b"!")
sys.stdin.read()
"""

# A block server whose handshake (or its LOCAL_REPLY) names another process: argv[1] "ready"
# or "reply", argv[2] the pid to name.
_LIAR = """
import os, sys, threading
from tiersync.net import handshake, source
from tiersync.net.source import MemoryBlockSource
from tiersync.net.tcp import TcpConfig, TcpTransport
what, pid = sys.argv[1], int(sys.argv[2])
if what == "ready":
    handshake.os = type("os", (), {"getpid": staticmethod(lambda: pid), "urandom": os.urandom})
else:
    source.os = type("os", (), {"getpid": staticmethod(lambda: pid)})
server = TcpTransport(TcpConfig(token=sys.argv[3])).serve("127.0.0.1:0", MemoryBlockSource({b"k" * 16: b"x" * 65536}))
print(server.address, flush=True)
sys.stdin.read()
"""


def _loopback_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    return client, server


def test_the_holder_of_the_far_end_is_told_from_any_other_process():
    client, server = _loopback_pair()
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holds_peer_end(os.getpid(), client)  # an in-process server: this process
        assert not holds_peer_end(os.getppid(), client) and not holds_peer_end(holder.pid, client)
        far = socket.create_connection(("127.0.0.1", int(holder.stdout.readline())))
        assert far.recv(1) == b"!"  # accepted: the holder has it open now
        assert holds_peer_end(holder.pid, far) and not holds_peer_end(os.getpid(), far)
        assert not holds_peer_end(2**22 + 12345, far)  # no such process
        far.close()
    finally:
        holder.stdin.close()
        holder.wait(10)
        client.close()
        server.close()


@pytest.fixture
def liar(request):
    what = request.param
    proc = subprocess.Popen(
        [sys.executable, "-c", _LIAR, what, str(os.getpid()), TOKEN],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        yield what, proc.stdout.readline().strip()
    finally:
        proc.stdin.close()
        proc.wait(10)


@pytest.mark.parametrize("liar", ["ready", "reply"], indirect=True)
def test_a_server_naming_this_process_gets_no_same_host_read_of_it(liar):
    """A same-host server that names the client's own pid in its READY gets no same-host read
    (the pid does not hold its end of the connection: checked before the first, AUTO reads over
    TCP, a forced LOCAL raises); one that names it in a LOCAL_REPLY is a protocol error before
    anything is copied."""
    from tiersync.net import store_ops as so

    what, address = liar
    channel = TcpTransport(TcpConfig(token=TOKEN)).connect(address)
    try:
        assert channel.info.same_host  # what the server claims
        lease = channel.request(so.ReadLease(channel.new_request_id(), (b"k" * 16,))).lease_id
        dest = bytearray(65536)
        if what == "ready":  # AUTO reads over TCP instead
            channel.pull_many(lease, [(b"k" * 16, 0, memoryview(dest))])
            assert dest == b"x" * 65536
            forced = TcpTransport(TcpConfig(token=TOKEN, route=Route.LOCAL)).connect(address)
            with pytest.raises(LocalReadError, match="does not hold"):  # and a forced same-host read is refused
                forced.pull_many(lease, [(b"k" * 16, 0, memoryview(dest))])
            forced.close()
        else:
            with pytest.raises(ProtocolError) as info:
                channel.pull_many(lease, [(b"k" * 16, 0, memoryview(dest))])
            assert info.value.fault is ProtocolFault.MALFORMED and dest == bytes(65536)
    finally:
        channel.close()
