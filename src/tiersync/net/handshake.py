"""The one handshake of every link: HELLO -> CHALLENGE -> AUTH -> READY.

Mutual shared-token HMAC (:mod:`tiersync.net.auth`), payload checksum negotiation, each
side's host identity and pid (so both know when the other is on the same host), and each
side's largest frame (neither sends the other a frame it would refuse). The
client side runs blocking over a :class:`~tiersync.net.socket_io.FramedSocket`; the server side
is sans-IO (:class:`ServerHandshake`: events in, frames out) so a selector drives thousands
of half-open connections without a thread each.
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, TypeVar

from tiersync.errors import TierSyncError
from tiersync.net import auth
from tiersync.net import events as ev
from tiersync.net.errors import AuthError, PeerClosedError, ProtocolError
from tiersync.net.frames import negotiate
from tiersync.net.local import host_identity, same_host
from tiersync.net.protocol import Connection, Role
from tiersync.net.service import PeerInfo
from tiersync.net.socket_io import peer_ip

if TYPE_CHECKING:
    from tiersync.net.socket_io import Deadline, FramedSocket

__all__ = ["ServerHandshake", "client_handshake", "refuse_over_cap"]

_E = TypeVar("_E")


def client_handshake(framed: FramedSocket, token: bytes | None, node_id: str, deadline: Deadline) -> PeerInfo:
    """Run the client side on ``framed``; returns what the server told about itself.
    Raises AuthError when either side lacks the token (or the server refused us; a server
    that fails our check is told so, ERROR AUTH_FAILED, so both ends log the refusal),
    PeerClosedError when the server ended the connection (e.g. over its connection cap)."""
    nonce = auth.new_nonce()
    limit = framed.conn.config.max_frame_size
    framed.write(ev.Hello(node_id, nonce, host=host_identity(), pid=os.getpid(), max_frame=limit), deadline)
    challenge = _expect(framed, ev.Challenge, deadline)
    if token is not None and not auth.proof_ok(auth.server_proof(token, nonce, challenge.nonce), challenge.proof):
        try:  # tell the server why, so it logs the refusal too (best effort)
            framed.write(ev.Error(0, ev.ErrorCode.AUTH_FAILED, "server failed to prove the shared token"), deadline)
        except (TierSyncError, OSError):
            pass
        raise AuthError("server failed to prove the shared token", peer=framed.peer)
    framed.write(ev.Auth(auth.client_proof(token, nonce, challenge.nonce)), deadline)
    ready = _expect(framed, ev.Ready, deadline)
    same = same_host(ready.host, peer_ip(framed.sock))  # the pid it names: checked before a same-host read
    return PeerInfo("", ready.host, ready.pid, same, min(ready.max_frame or limit, limit))


def _expect(framed: FramedSocket, kind: type[_E], deadline: Deadline) -> _E:
    event = framed.read(deadline)
    if isinstance(event, ev.Error):
        if event.code is ev.ErrorCode.AUTH_FAILED:
            raise AuthError(f"peer refused authentication: {event.message}", peer=framed.peer)
        raise PeerClosedError(f"server refused the connection: {event.message}", peer=framed.peer, code=event.code.name)
    if not isinstance(event, kind):
        raise PeerClosedError(f"handshake ended by {type(event).__name__}", peer=framed.peer)
    return event


class ServerHandshake:
    """Server side for one connection: feed each event to :meth:`step`, send what it returns.

    ``done`` is set (and :attr:`info` filled) once READY is returned. A peer that fails the
    token check (or offers no common checksum) gets an ERROR frame and ``failed`` names why:
    send the frames, then close.
    """

    def __init__(self, conn: Connection, token: bytes | None, session_id: int, peer_ip: str = "") -> None:
        self.conn, self.token, self.session_id, self.peer_ip = conn, token, session_id, peer_ip
        self._hello: ev.Hello | None = None
        self._nonce = b""
        self.done = False
        self.failed: str | None = None
        self.info: PeerInfo | None = None

    def step(self, event: object) -> list[bytes | memoryview]:
        """Frames to send in answer to ``event`` (a handshake event from the client)."""
        if self._hello is None:
            if not isinstance(event, ev.Hello):
                return self._refuse("expected HELLO")
            return self._challenge(event)
        if not isinstance(event, ev.Auth):
            return self._refuse("expected AUTH")
        hello = self._hello
        if not auth.proof_ok(auth.client_proof(self.token, hello.nonce, self._nonce), event.proof):
            return self._refuse("bad token proof")
        self.done = True
        same = same_host(hello.host, self.peer_ip)
        limit = self.conn.config.max_frame_size
        self.info = PeerInfo(hello.node_id, hello.host, hello.pid, same, min(hello.max_frame or limit, limit))
        return self.conn.send(ev.Ready(self.session_id, host_identity(), os.getpid(), limit))

    def _challenge(self, hello: ev.Hello) -> list[bytes | memoryview]:
        try:
            algo = negotiate(hello.checksums)
        except ProtocolError as exc:
            self.failed = exc.message
            return self.conn.send(ev.Error(0, ev.ErrorCode.UNSUPPORTED, exc.message))
        self._hello, self._nonce = hello, auth.new_nonce()
        proof = auth.server_proof(self.token, hello.nonce, self._nonce)
        return self.conn.send(ev.Challenge(self._nonce, proof, algo))

    def _refuse(self, why: str) -> list[bytes | memoryview]:
        self.failed = why
        return self.conn.send(ev.Error(0, ev.ErrorCode.AUTH_FAILED, "authentication failed"))


def refuse_over_cap(sock: socket.socket, cap: int, tls: bool) -> None:
    """Tell a connection over the cap why, then close it (best effort, never blocks). A TLS
    client is only closed on: plaintext in its handshake reads as a TLS failure."""
    try:
        if tls:
            return
        sock.setblocking(False)
        conn = Connection(Role.SERVER)
        frame = b"".join(
            bytes(b) for b in conn.send(ev.Error(0, ev.ErrorCode.CAPACITY, f"too many connections (the cap is {cap})"))
        )
        sock.send(frame)
    except OSError:
        pass
    finally:
        sock.close()
