"""TCP transport: tuned sockets, zero-copy scatter-gather I/O, deadlines, token + TLS.

Sockets get SO_SNDBUF/SO_RCVBUF (16 MiB default) and TCP_NODELAY. Sends use
``socket.sendmsg`` over the frame's buffers (header+metadata, payload view),
resuming after partial sends; payloads are received with ``recv_into`` straight
into the caller's buffer. Every blocking call runs under a deadline and raises
:class:`NetTimeoutError` (with ``peer``) when it passes (plain TCP: at most
``_SLACK`` of the time that was left late, see :class:`~tiersync.net.framed.FramedSocket`).
"""
from __future__ import annotations

import collections
import itertools
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from tiersync.errors import ClosedError, UsageError
from tiersync.net import auth
from tiersync.net import events as ev
from tiersync.net.errors import (AuthError, NetTimeoutError, PeerClosedError, ProtocolError, ProtocolFault,
                                 RequestError)
from tiersync.net.framed import Deadline, FramedSocket, io_errors, tune
from tiersync.net.frames import PayloadChecksum, ProtocolConfig
from tiersync.net.protocol import Connection, Role
from tiersync.net.tls import TlsConfig, client_context
from tiersync.net.transport import Channel, Handler, Server, Transport

@dataclass(frozen=True, slots=True)
class TcpConfig:
    """Settings of one TCP transport (both client and server side).

    ``token``: shared secret; when set, peers must prove it (HMAC) and so must we.
    ``tls``: optional :class:`TlsConfig`. Timeouts are seconds (> 0).
    Raises UsageError on invalid values.
    """

    sndbuf: int = 16 << 20
    rcvbuf: int = 16 << 20
    nodelay: bool = True
    connect_timeout_s: float = 5.0
    op_timeout_s: float = 120.0
    token: bytes | None = None
    tls: TlsConfig | None = None
    node_id: str = "tiersync"
    recv_chunk: int = 256 << 10
    backlog: int = 64
    protocol: ProtocolConfig = field(default_factory=ProtocolConfig)

    def __post_init__(self) -> None:
        for name in ("sndbuf", "rcvbuf", "recv_chunk", "backlog"):
            if getattr(self, name) <= 0:
                raise UsageError("must be > 0", argument=name)
        for name in ("connect_timeout_s", "op_timeout_s"):
            if not getattr(self, name) > 0:
                raise UsageError("must be > 0 seconds", argument=name)
        if self.token is not None and (not isinstance(self.token, bytes) or len(self.token) < 16):
            raise UsageError("must be bytes of at least 16", argument="token")


def parse_address(address: str) -> tuple[str, int]:
    """Split "host:port". Raises UsageError when malformed."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise UsageError("must be 'host:port'", argument="address", value=address)
    return host.strip("[]"), int(port)


class TcpChannel(Channel):
    """Client side of one TCP connection. Use :meth:`TcpTransport.connect` to build."""

    def __init__(self, framed: FramedSocket) -> None:
        self._framed = framed
        self.peer = framed.peer
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = False

    def handshake(self, deadline: Deadline) -> None:
        """Run HELLO/CHALLENGE/AUTH/READY. Raises AuthError when either side lacks the token."""
        token, nonce = self._framed.cfg.token, auth.new_nonce()
        self._framed.write(ev.Hello(self._framed.cfg.node_id, nonce), deadline)
        challenge = self._expect(ev.Challenge, deadline)
        if token is not None and not auth.proof_ok(auth.server_proof(token, nonce, challenge.nonce), challenge.proof):
            raise AuthError("server failed to prove the shared token", peer=self.peer)
        self._framed.write(ev.Auth(auth.client_proof(token, nonce, challenge.nonce)), deadline)
        self._expect(ev.Ready, deadline)

    def _expect(self, kind: type, deadline: Deadline):
        event = self._framed.read(deadline)
        if isinstance(event, ev.Error) and event.code is ev.ErrorCode.AUTH_FAILED:
            raise AuthError(f"peer refused authentication: {event.message}", peer=self.peer)
        if not isinstance(event, kind):
            raise PeerClosedError(f"handshake ended by {type(event).__name__}", peer=self.peer)
        return event

    def new_request_id(self) -> int:
        return next(self._ids)

    @property
    def payload_checksum(self) -> PayloadChecksum:
        """The payload checksum negotiated in the handshake."""
        return self._framed.conn.payload_algo

    def request(self, event: object, *, timeout: float | None = None, into: memoryview | None = None) -> object:
        with self._lock:
            self._check_open()
            deadline = Deadline(timeout or self._framed.cfg.op_timeout_s, self.peer)
            try:
                self._framed.write(event, deadline)
                if into is None:
                    return self._answer(event.request_id, deadline)
                self._framed.conn.expect_payload_into(event.request_id, into)
                return self._answer(event.request_id, deadline, data=True)
            except (PeerClosedError, ProtocolError, NetTimeoutError, AuthError):
                self._shut()
                raise

    def pull_many(self, lease_id: int, items: Sequence[tuple[bytes, int, memoryview]], *,
                  window: int = 8, timeout: float | None = None) -> None:
        """Pull ``(key, offset, dest)`` items under ``lease_id``, keeping ``window`` requests in
        flight on this one connection so the round trip of one hides behind the next.

        Each payload lands straight in its ``dest`` (exact size). One deadline covers the
        whole batch. Raises like :meth:`request` (an ERROR answer raises RequestError after
        the channel is closed, since later answers are still in flight).
        """
        if window < 1:
            raise UsageError("must be >= 1", argument="window", value=window)
        with self._lock:
            self._check_open()
            deadline = Deadline(timeout or self._framed.cfg.op_timeout_s, self.peer)
            todo, pending = iter(self._pulls(lease_id, items)), collections.deque()
            try:
                half = max(1, window // 2)
                self._send_pulls(todo, window, pending, deadline)
                while pending:  # up to half a window landed per native call, then refilled at once
                    for _ in range(self._expect_data(list(itertools.islice(pending, half)), deadline)):
                        pending.popleft()
                    if len(pending) <= window - half:
                        self._send_pulls(todo, window - len(pending), pending, deadline)
            except (PeerClosedError, ProtocolError, NetTimeoutError, AuthError, RequestError):
                self._shut()
                raise

    def _pulls(self, lease_id: int, items) -> list[tuple[ev.Pull, memoryview]]:
        """Validate every item before anything is sent (UsageError naming ``items``)."""
        out = []
        for key, offset, dest in items:
            try:
                view = memoryview(dest).cast("B")
            except TypeError as exc:
                raise UsageError("destinations must be contiguous buffers", argument="items") from exc
            if view.readonly:
                raise UsageError("destinations must be writable", argument="items")
            out.append((ev.Pull(next(self._ids), lease_id, key, offset, len(view)), view))
        return out

    def _send_pulls(self, todo, n: int, pending: collections.deque, deadline: Deadline) -> None:
        """Encode up to ``n`` more PULLs from ``todo``, register their buffers, send them in one go."""
        conn, bufs = self._framed.conn, []
        for pull, dest in itertools.islice(todo, n):
            bufs += conn.send(pull)
            conn.expect_payload_into(pull.request_id, dest)
            pending.append(pull.request_id)
        if bufs:
            self._framed.send_buffers(bufs, deadline)

    def _expect_data(self, request_ids: list[int], deadline: Deadline) -> int:
        """Receive the DATA answers to the first of ``request_ids`` (at least one); how many."""
        events = self._framed.read_data(request_ids, deadline)
        for rid, event in zip(request_ids, events):
            if not isinstance(self._check_answer(rid, event), ev.Data):
                raise ProtocolError("expected DATA", fault=ProtocolFault.UNEXPECTED, peer=self.peer)
        return len(events)

    def next_answer(self, request_id: int, *, timeout: float | None = None) -> object:
        with self._lock:
            self._check_open()
            try:
                return self._answer(request_id, Deadline(timeout or self._framed.cfg.op_timeout_s, self.peer))
            except (PeerClosedError, ProtocolError, NetTimeoutError, AuthError):
                self._shut()
                raise

    def _answer(self, request_id: int, deadline: Deadline, *, data: bool = False) -> object:
        """The next event as the answer to ``request_id`` (``data``: a DATA into a registered buffer
        is expected, so the fast receive path may take it); raises for anything else."""
        event = self._framed.read_data([request_id], deadline)[0] if data else self._framed.read(deadline)
        return self._check_answer(request_id, event)

    def _check_answer(self, request_id: int, event: object) -> object:
        if isinstance(event, ev.ConnectionClosed):
            raise PeerClosedError("peer closed the connection", peer=self.peer)
        if isinstance(event, ev.Error):
            if event.request_id == 0:
                raise PeerClosedError(f"peer ended the connection: {event.message}", peer=self.peer)
            raise RequestError(event.message or "request failed", code=event.code, peer=self.peer)
        if getattr(event, "request_id", None) != request_id:
            raise ProtocolError("peer sent a request on a client channel", fault=ProtocolFault.UNEXPECTED,
                                peer=self.peer)
        return event

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("channel closed", peer=self.peer)

    def _shut(self) -> None:
        if not self._closed:
            self._closed = True
            self._framed.close()

    def close(self) -> None:
        """Close now; a request running in another thread fails with PeerClosedError."""
        self._shut()

    @property
    def closed(self) -> bool:
        return self._closed


class TcpTransport(Transport):
    """Connects and serves over TCP with ``config``."""

    def __init__(self, config: TcpConfig | None = None) -> None:
        self.config = config or TcpConfig()

    def connect(self, address: str, *, timeout: float | None = None) -> TcpChannel:
        host, port = parse_address(address)
        deadline = Deadline(timeout or self.config.connect_timeout_s, address)
        with io_errors(address):
            sock = socket.create_connection((host, port), timeout=deadline.remaining())
        try:
            tune(sock, self.config)
            sock = self._wrap_tls(sock, host, deadline, address)
            channel = TcpChannel(FramedSocket(sock, Connection(Role.CLIENT, self.config.protocol), address, self.config))
            channel.handshake(deadline)
        except BaseException:
            sock.close()
            raise
        return channel

    def _wrap_tls(self, sock: socket.socket, host: str, deadline: Deadline, peer: str) -> socket.socket:
        tls = self.config.tls
        if tls is None:
            return sock
        with io_errors(peer):
            sock.settimeout(deadline.remaining())
            return client_context(tls).wrap_socket(sock, server_hostname=tls.server_hostname or host)

    def serve(self, address: str, handler: Handler) -> Server:
        from tiersync.net.tcp_server import TcpServer

        return TcpServer(address, handler, self.config)
