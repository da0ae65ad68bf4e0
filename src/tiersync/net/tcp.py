"""TCP transport: tuned sockets, zero-copy scatter-gather I/O, deadlines, token + TLS.

Sockets get SO_SNDBUF/SO_RCVBUF (16 MiB default) and TCP_NODELAY. Sends use
``socket.sendmsg`` over the frame's buffers (header+metadata, payload view),
resuming after partial sends; payloads are received with ``recv_into`` straight
into the caller's buffer. Every blocking call runs under a deadline and raises
:class:`NetTimeoutError` (with ``peer``) when it passes (plain TCP: at most
``_SLACK`` of the time that was left late, see :class:`FramedSocket`).
"""
from __future__ import annotations

import collections
import itertools
import socket
import ssl
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from tiersync.errors import ClosedError, UsageError
from tiersync.iov import consume
from tiersync.net import auth
from tiersync.net import events as ev
from tiersync.net.errors import (AuthError, NetTimeoutError, PeerClosedError, ProtocolError, ProtocolFault,
                                 RequestError)
from tiersync.net.frames import EMPTY_META_CHECKSUM, HEADER_SIZE, SUPPORTED, PayloadChecksum, ProtocolConfig
from tiersync.net.protocol import NEED_DATA, Connection, Role
from tiersync.net.tls import TlsConfig, client_context
from tiersync.net.transport import Channel, Handler, Server, Transport

try:  # the receive fast path (GIL released); without it every frame takes the reference path
    from tiersync.net import _wire
except ImportError:  # pragma: no cover - depends on the build
    _wire = None
if PayloadChecksum.TSUM64 not in SUPPORTED:  # pragma: no cover - the fallback must verify what it accepts
    _wire = None

_IOV_MAX = 1024
_PIECE = 4 << 20  # most bytes one recv lands in a payload before the checksum reads them
_SLACK = 0.05  # re-arm a kernel timeout once it is off by more than this share of what is left
_TIMEVAL = struct.Struct("@ll")


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


class Deadline:
    """Absolute deadline for one operation against ``peer``."""

    __slots__ = ("_end", "peer", "_timeout")

    def __init__(self, timeout: float, peer: str) -> None:
        self._timeout, self.peer = timeout, peer
        self._end = time.monotonic() + timeout

    def remaining(self) -> float:
        """Seconds left; raises NetTimeoutError when none are."""
        left = self._end - time.monotonic()
        if left <= 0:
            raise NetTimeoutError("operation timed out", peer=self.peer, timeout_s=self._timeout)
        return left


def tune(sock: socket.socket, cfg: TcpConfig) -> None:
    """Apply buffer sizes and TCP_NODELAY."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, cfg.sndbuf)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, cfg.rcvbuf)
    if cfg.nodelay:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class FramedSocket:
    """A socket plus a sans-IO :class:`Connection`: writes events, reads events.

    Plain TCP runs the socket in blocking mode with kernel timeouts (SO_RCVTIMEO /
    SO_SNDTIMEO) re-armed only when the deadline has moved by more than ``_SLACK``
    of what is left, so one recv or sendmsg is one syscall (no poll, no ioctl). While a
    payload buffer is registered, a frame starts with one scatter read (``recvmsg_into``)
    of the header plus the buffer the next DATA should land in (a pipelined answer that
    already arrived whole takes one syscall), and the rest of a payload comes with
    MSG_WAITALL straight into the buffer, in pieces of ``_PIECE`` so the checksum reads
    them while they are still in cache. TLS sockets use Python timeouts, no scatter.
    """

    def __init__(self, sock: socket.socket, conn: Connection, peer: str, cfg: TcpConfig) -> None:
        self.sock, self.conn, self.peer, self.cfg = sock, conn, peer, cfg
        self._rbuf = bytearray(cfg.recv_chunk)
        self._rview = memoryview(self._rbuf)
        self._hview = memoryview(bytearray(HEADER_SIZE))
        self._tls = isinstance(sock, ssl.SSLSocket)
        self._armed = {socket.SO_RCVTIMEO: 0.0, socket.SO_SNDTIMEO: 0.0}
        if not self._tls:
            sock.settimeout(None)

    def _arm(self, which: int, deadline: Deadline) -> None:
        """Bound the next blocking call by the deadline (raises NetTimeoutError when it passed)."""
        left = deadline.remaining()
        if self._tls:
            self.sock.settimeout(left)
            return
        armed = self._armed[which]
        if armed > left * (1 + _SLACK) + 0.001 or armed < left * (1 - _SLACK):
            sec = int(left)
            self.sock.setsockopt(socket.SOL_SOCKET, which, _TIMEVAL.pack(sec, max(1, int((left - sec) * 1e6))))
            self._armed[which] = left

    def write(self, event: object, deadline: Deadline) -> None:
        self.send_buffers(self.conn.send(event), deadline)

    def send_buffers(self, bufs: list, deadline: Deadline) -> None:
        """Write encoded frames (``Connection.send`` output, possibly several concatenated)."""
        views = [b for b in bufs if len(b)]
        try:
            while views:
                self._arm(socket.SO_SNDTIMEO, deadline)
                if self._tls:  # SSLSocket has no sendmsg
                    self.sock.sendall(views.pop(0))
                    continue
                try:
                    consume(views, self.sock.sendmsg(views[:_IOV_MAX]))
                except BlockingIOError:  # the kernel timeout fired; _arm decides if the deadline did
                    continue
        except NetTimeoutError:
            raise
        except OSError as exc:
            _raise_io(exc, self.peer)

    def read(self, deadline: Deadline) -> object:
        """Next event (or ConnectionClosed); receives payloads into registered sinks."""
        conn = self.conn
        try:
            while True:
                event = conn.next_event()
                if event is not NEED_DATA:
                    return event
                self._arm(socket.SO_RCVTIMEO, deadline)
                try:
                    self._recv_once()
                except BlockingIOError:
                    continue
        except NetTimeoutError:
            raise
        except OSError as exc:
            _raise_io(exc, self.peer)

    def read_data(self, request_id: int, deadline: Deadline) -> object:
        """Like :meth:`read` where the next frame should be the DATA answer to ``request_id``: with
        the native receiver (plain TCP), one GIL-free call lands the frame in its registered buffer
        and verifies it as the parser would (:meth:`Connection.data_fast_received`); whatever it did
        not verify goes to the reference parser (:meth:`Connection.scatter_received`)."""
        conn = self.conn
        if _wire is None or self._tls:
            return self.read(deadline)
        try:
            while (dest := conn.data_fast_target(request_id)) is not None:
                self._arm(socket.SO_RCVTIMEO, deadline)
                try:
                    n, ok, value = _wire.recv_data(self.sock.fileno(), self._hview, dest, request_id,
                                                   conn.config.max_frame_size, EMPTY_META_CHECKSUM)
                except (BlockingIOError, InterruptedError):
                    continue
                if ok:
                    return conn.data_fast_received(request_id, value)
                conn.scatter_received(self._hview, n)
                break
        except NetTimeoutError:
            raise
        except OSError as exc:
            _raise_io(exc, self.peer)
        return self.read(deadline)

    def _recv_once(self) -> None:
        """One recv, fed to the connection: into the payload being received, else header plus
        the next expected payload in one scatter read, else into the read buffer."""
        conn, sock = self.conn, self.sock
        sink = conn.payload_sink()
        if sink is not None:
            if self._tls:
                n = sock.recv_into(sink)
            else:
                n = sock.recv_into(sink[:_PIECE] if len(sink) > _PIECE else sink, 0, socket.MSG_WAITALL)
            return conn.payload_received(n) if n else conn.receive_data(b"")
        hint = 0
        if not self._tls:
            target = conn.scatter_target()
            if target is not None:
                return conn.scatter_received(self._hview, sock.recvmsg_into([self._hview, target])[0])
            hint = conn.read_hint()
        view = self._rview[:hint] if hint else self._rview
        n = sock.recv_into(view, 0, socket.MSG_WAITALL) if hint else sock.recv_into(view)
        conn.receive_data(view[:n] if n else b"")

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _raise_io(exc: OSError, peer: str) -> None:
    """Raise the RemoteError family member for socket error ``exc``, naming ``peer``."""
    if isinstance(exc, socket.timeout):
        raise NetTimeoutError("socket operation timed out", peer=peer) from exc
    if isinstance(exc, ssl.SSLError):
        raise AuthError(f"TLS failure: {exc.reason or exc}", peer=peer) from exc
    raise PeerClosedError(f"connection failed: {exc}", peer=peer) from exc


class _io_errors:
    """Map socket exceptions to the RemoteError family, naming the peer (a context manager)."""

    def __init__(self, peer: str) -> None:
        self.peer = peer

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if isinstance(exc, OSError) and not isinstance(exc, NetTimeoutError):
            _raise_io(exc, self.peer)
        return False


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
                self._send_pulls(todo, window, pending, deadline)
                while pending:
                    self._expect_data(pending.popleft(), deadline)
                    if len(pending) <= window - max(1, window // 2):  # refill in batches: fewer syscalls
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

    def _expect_data(self, request_id: int, deadline: Deadline) -> None:
        answer = self._answer(request_id, deadline, data=True)
        if not isinstance(answer, ev.Data):
            raise ProtocolError("expected DATA", fault=ProtocolFault.UNEXPECTED, peer=self.peer)

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
        event = self._framed.read_data(request_id, deadline) if data else self._framed.read(deadline)
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
        with _io_errors(address):
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
        with _io_errors(peer):
            sock.settimeout(deadline.remaining())
            return client_context(tls).wrap_socket(sock, server_hostname=tls.server_hostname or host)

    def serve(self, address: str, handler: Handler) -> Server:
        from tiersync.net.tcp_server import TcpServer

        return TcpServer(address, handler, self.config)
