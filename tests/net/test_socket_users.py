"""tiersync.net.socket_users: a socket closed while other threads use it by its number keeps
that number until the last of them is out (real sockets, real threads)."""

from __future__ import annotations

import socket
import threading

import pytest

from _peer import blocked_reader
from tiersync.net import socket_io
from tiersync.net.config import TcpConfig
from tiersync.net.errors import PeerClosedError
from tiersync.net.protocol import Connection, Role
from tiersync.net.socket_io import Deadline, FramedSocket
from tiersync.net.socket_users import SocketUsers


@pytest.fixture()
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_closed_while_in_use_it_is_shut_down_at_once_and_closed_by_the_last_user(pair):
    a, b = pair
    users = SocketUsers(a, "pair")
    with users:
        with users:
            users.close()
            assert a.fileno() != -1  # shut down, not closed: calls still use its number
            b.settimeout(5)
            assert b.recv(1) == b""  # the peer saw the shutdown at once
        assert a.fileno() != -1
    assert a.fileno() == -1
    with pytest.raises(PeerClosedError), users:
        pass
    users.close()  # twice: nothing more


def test_closed_while_idle_it_is_closed_at_once(pair):
    a, _ = pair
    users = SocketUsers(a, "pair")
    with users:
        pass
    users.close()
    assert a.fileno() == -1


class _HeldAtEnd(Connection):
    """Blocks in the end-of-stream it is fed until ``release`` is set (a reader woken by the
    shutdown, still inside its read)."""

    def __init__(self) -> None:
        super().__init__(Role.CLIENT)
        self.entered, self.woken, self.release = threading.Event(), threading.Event(), threading.Event()

    def next_event(self) -> object:
        self.entered.set()  # the reader is inside its read
        return super().next_event()

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        if not len(data):
            self.woken.set()
            self.release.wait(10)
        super().receive_data(data)


def test_a_framed_socket_closed_under_a_blocked_reader_keeps_its_number_until_the_reader_left(pair, monkeypatch):
    """Before: ``close`` closed the socket while the reader could still call ``recv`` by its
    number, which the next connection opened may be given."""
    monkeypatch.setattr(socket_io, "_wire", None)  # the Python reader: it reads by the number
    a, _ = pair
    conn = _HeldAtEnd()
    framed = FramedSocket(a, conn, "pair", TcpConfig())
    outcome: list[object] = []
    reader = threading.Thread(target=lambda: outcome.append(_read(framed)))
    reader.start()
    assert conn.entered.wait(10)
    framed.close()  # from this thread, while the reader waits in recv
    assert conn.woken.wait(10)
    assert a.fileno() != -1  # the reader is still inside its read
    conn.release.set()
    reader.join(10)
    assert not reader.is_alive() and outcome and a.fileno() == -1
    with pytest.raises(PeerClosedError):
        framed.read(Deadline(1, "pair"))


def _read(framed: FramedSocket) -> object:
    try:
        return framed.read(Deadline(20, "pair"))
    except PeerClosedError as exc:
        return exc


@pytest.mark.parametrize("tls", [False, True])
def test_a_channel_closed_from_another_thread_fails_its_blocked_reader_as_closed(tls, tmp_path):
    """The reader waiting for an answer gets PeerClosedError (over TLS too: the shutdown keeps
    the TLS state until the last user closes the socket, so no record bytes reach the parser
    and no "unwrapped SSL socket" ValueError escapes)."""
    from tiersync.net.tcp import TcpTransport
    from tiersync.net.tls import TlsConfig

    client, server_cfg = TcpConfig(token=b"t" * 32), TcpConfig(token=b"t" * 32)
    if tls:
        pytest.importorskip("cryptography")
        from _certs import make_ca, make_leaf

        ca = make_ca(tmp_path)
        cert, key = make_leaf(tmp_path, ca, "server")
        client = TcpConfig(token=b"t" * 32, tls=TlsConfig(ca[2]))
        server_cfg = TcpConfig(token=b"t" * 32, tls=TlsConfig(ca[2], cert, key))
    from tiersync.net.source import MemoryBlockSource

    server = TcpTransport(server_cfg).serve("127.0.0.1:0", MemoryBlockSource({}))
    channel = TcpTransport(client).connect(server.address)
    try:
        reader, outcome = blocked_reader(channel)
        channel.close()
        reader.join(10)
        assert not reader.is_alive() and len(outcome) == 1
        assert isinstance(outcome[0], PeerClosedError), repr(outcome[0])
    finally:
        channel.close()
        server.close()
