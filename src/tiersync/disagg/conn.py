"""A blocking socket around :mod:`tiersync.disagg.wire`: deadlines, errors, token handshake.

Every call takes an absolute ``deadline`` (``time.monotonic()`` seconds) and raises
:class:`~tiersync.net.errors.NetTimeoutError` past it; socket failures become
:class:`~tiersync.net.errors.PeerClosedError`, bad frames
:class:`~tiersync.net.errors.ProtocolError`, a refused or failed proof
:class:`~tiersync.net.errors.AuthError`, an ERROR frame
:class:`~tiersync.net.errors.RequestError` (``code`` = the peer's code string). After any
of these the connection must be closed.
"""
from __future__ import annotations

import socket
import time
from typing import Any, Callable, Sequence

from tiersync.disagg.wire import Decoder, Frame, Kind, WireLimits, encode
from tiersync.iov import consume
from tiersync.net import auth
from tiersync.net.errors import AuthError, NetTimeoutError, PeerClosedError, ProtocolError, ProtocolFault, RequestError

__all__ = ["FrameSocket", "client_handshake", "server_handshake"]

_IOV_MAX = 512
Sink = Callable[[Frame], Any]


class FrameSocket:
    """One connection: :meth:`send` frames, :meth:`recv` frames (payloads into sinks)."""

    def __init__(self, sock: socket.socket, peer: str, limits: WireLimits) -> None:
        self.sock, self.peer = sock, peer
        self._decoder = Decoder(limits)

    def _timeout(self, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise NetTimeoutError("deadline passed", peer=self.peer)
        return left

    def send(self, kind: Kind, meta: dict | None, deadline: float, payload: Sequence[Any] = ()) -> None:
        views = encode(kind, meta, payload)
        try:
            while views:
                self.sock.settimeout(self._timeout(deadline))
                consume(views, self.sock.sendmsg(views[:_IOV_MAX]))
        except socket.timeout:
            raise NetTimeoutError("send timed out", peer=self.peer) from None
        except OSError as exc:
            raise PeerClosedError(f"send failed: {exc}", peer=self.peer) from None

    def recv(self, deadline: float, sink: Sink | None = None) -> Frame:
        """The next complete frame. ``sink(frame_head)`` may return a writable view of exactly
        ``payload_len`` bytes to receive the payload in place. An ERROR frame raises
        RequestError; EOF raises PeerClosedError."""
        while True:
            event = self._decoder.next_event()
            if event is None:
                raise PeerClosedError("peer closed the connection", peer=self.peer)
            if isinstance(event, Frame):
                if event.payload is None:
                    self._decoder.set_sink(sink(event) if sink is not None else None)
                    continue
                if event.kind is Kind.ERROR:
                    meta = event.meta
                    raise RequestError(str(meta.get("message", ""))[:512], code=str(meta.get("code", "?"))[:64],
                                       peer=self.peer)
                return event
            self._fill(deadline)

    def _fill(self, deadline: float) -> None:
        view = self._decoder.recv_view()
        try:
            self.sock.settimeout(self._timeout(deadline))
            n = self.sock.recv_into(view)
        except socket.timeout:
            raise NetTimeoutError("receive timed out", peer=self.peer) from None
        except OSError as exc:
            raise PeerClosedError(f"receive failed: {exc}", peer=self.peer) from None
        try:
            self._decoder.received(n)
        except ProtocolError as exc:
            exc.peer = self.peer
            raise

    def expect(self, kind: Kind, deadline: float, sink: Sink | None = None) -> Frame:
        frame = self.recv(deadline, sink)
        if frame.kind is not kind:
            raise ProtocolError(f"expected {kind.name}, got {frame.kind.name}", fault=ProtocolFault.UNEXPECTED,
                                peer=self.peer)
        return frame

    def send_error(self, code: str, message: str, deadline: float) -> None:
        """Best effort: tell the peer why we close (never raises)."""
        try:
            self.send(Kind.ERROR, {"code": code, "message": message[:512]}, min(deadline, time.monotonic() + 1.0))
        except Exception:  # noqa: BLE001 - the connection is being closed anyway
            pass

    def shutdown(self) -> None:
        """Wake and fail any thread blocked on this connection; safe from another thread (the
        owning thread still calls :meth:`close`)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        """Shut down and release the socket; only the thread that uses the connection calls it."""
        self.shutdown()
        self.sock.close()


def _nonce(meta: dict, peer: str) -> bytes:
    try:
        value = bytes.fromhex(meta.get("nonce", ""))
    except (TypeError, ValueError):
        value = b""
    if len(value) != 16:
        raise ProtocolError("bad nonce", fault=ProtocolFault.MALFORMED, peer=peer)
    return value


def _proof(meta: dict) -> bytes:
    try:
        return bytes.fromhex(meta.get("proof", ""))
    except (TypeError, ValueError):
        return b"\0"


def client_handshake(fs: FrameSocket, token: bytes | None, deadline: float) -> None:
    """Mutual HMAC proof of ``token`` (see :mod:`tiersync.net.auth`). Raises AuthError."""
    nonce = auth.new_nonce()
    fs.send(Kind.HELLO, {"nonce": nonce.hex()}, deadline)
    try:
        challenge = fs.expect(Kind.CHALLENGE, deadline)
    except RequestError as exc:
        raise AuthError(f"peer refused the handshake: {exc.message}", peer=fs.peer) from None
    server_nonce = _nonce(challenge.meta, fs.peer)
    if token is not None and not auth.proof_ok(auth.server_proof(token, nonce, server_nonce), _proof(challenge.meta)):
        raise AuthError("producer failed to prove the shared token", peer=fs.peer)
    fs.send(Kind.AUTH, {"proof": auth.client_proof(token, nonce, server_nonce).hex()}, deadline)
    try:
        fs.expect(Kind.READY, deadline)
    except RequestError as exc:
        raise AuthError(f"peer refused authentication: {exc.message}", peer=fs.peer) from None


def server_handshake(fs: FrameSocket, token: bytes | None, deadline: float) -> None:
    """Server side of :func:`client_handshake`; sends ERROR{auth_failed} and raises AuthError
    when the client cannot prove ``token``."""
    hello = fs.expect(Kind.HELLO, deadline)
    client_nonce, nonce = _nonce(hello.meta, fs.peer), auth.new_nonce()
    fs.send(Kind.CHALLENGE, {"nonce": nonce.hex(), "proof": auth.server_proof(token, client_nonce, nonce).hex()},
            deadline)
    reply = fs.expect(Kind.AUTH, deadline)
    if token is not None and not auth.proof_ok(auth.client_proof(token, client_nonce, nonce), _proof(reply.meta)):
        fs.send_error("auth_failed", "token proof refused", deadline)
        raise AuthError("consumer failed to prove the shared token", peer=fs.peer)
    fs.send(Kind.READY, {}, deadline)
