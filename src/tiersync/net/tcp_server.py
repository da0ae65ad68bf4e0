"""TCP server side: accept loop, per-connection handshake and request dispatch."""
from __future__ import annotations

import itertools
import logging
import socket
import threading

from tiersync.errors import TierSyncError
from tiersync.net import auth
from tiersync.net import events as ev
from tiersync.net.errors import AuthError, ProtocolError
from tiersync.net.frames import negotiate
from tiersync.net.protocol import NEED_DATA, Connection, Role
from tiersync.net.framed import Deadline, FramedSocket, tune
from tiersync.net.tcp import TcpConfig, parse_address
from tiersync.net.tls import server_context
from tiersync.net.transport import Handler, Server

log = logging.getLogger(__name__)
_REQUESTS = (ev.Ping, ev.Offer, ev.ReadLease, ev.Pull, ev.Release)
_BATCH = 16  # most buffered requests answered in one send


class TcpServer(Server):
    """Serves ``handler`` on ``address``; ``address`` is updated with the bound port.

    Each connection gets a thread. A peer that fails the token or TLS check is
    sent ERROR(AUTH_FAILED) (when possible) and disconnected. Handler exceptions
    become ERROR(INTERNAL) answers; a peer's protocol error closes its connection.
    """

    def __init__(self, address: str, handler: Handler, config: TcpConfig) -> None:
        host, port = parse_address(address)
        self.config, self.handler = config, handler
        self._tls = server_context(config.tls) if config.tls is not None else None
        self._listener = socket.create_server((host, port), backlog=config.backlog)
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._conns: set[FramedSocket] = set()
        self._lock = threading.Lock()
        self._sessions = itertools.count(1)
        self.refused = 0
        self._thread = threading.Thread(target=self._accept_loop, name=f"tcp-accept-{self.address}", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve_one, args=(sock, f"{addr[0]}:{addr[1]}"), daemon=True).start()

    def _serve_one(self, sock: socket.socket, peer: str) -> None:
        framed = None
        try:
            tune(sock, self.config)
            deadline = Deadline(self.config.connect_timeout_s, peer)
            if self._tls is not None:
                sock.settimeout(deadline.remaining())
                sock = self._tls.wrap_socket(sock, server_side=True)
            framed = FramedSocket(sock, Connection(Role.SERVER, self.config.protocol), peer, self.config)
            with self._lock:
                if self._stop.is_set():
                    return
                self._conns.add(framed)
            self._handshake(framed, deadline)
            self._dispatch(framed)
        except (TierSyncError, OSError) as exc:
            log.debug("connection from %s ended: %s", peer, exc)
        finally:
            if framed is not None:
                with self._lock:
                    self._conns.discard(framed)
                framed.close()
            else:
                sock.close()

    def _handshake(self, framed: FramedSocket, deadline: Deadline) -> None:
        token = self.config.token
        hello = framed.read(deadline)
        if not isinstance(hello, ev.Hello):
            return self._refuse(framed, deadline, "expected HELLO")
        try:
            algo = negotiate(hello.checksums)
        except ProtocolError as exc:
            framed.write(ev.Error(0, ev.ErrorCode.UNSUPPORTED, exc.message), deadline)
            raise
        nonce = auth.new_nonce()
        framed.write(ev.Challenge(nonce, auth.server_proof(token, hello.nonce, nonce), algo), deadline)
        answer = framed.read(deadline)
        if not isinstance(answer, ev.Auth):
            return self._refuse(framed, deadline, "expected AUTH")
        if not auth.proof_ok(auth.client_proof(token, hello.nonce, nonce), answer.proof):
            return self._refuse(framed, deadline, "bad token proof")
        framed.write(ev.Ready(next(self._sessions)), deadline)

    def _refuse(self, framed: FramedSocket, deadline: Deadline, why: str) -> None:
        self.refused += 1
        framed.write(ev.Error(0, ev.ErrorCode.AUTH_FAILED, "authentication failed"), deadline)
        raise AuthError(why, peer=framed.peer)

    def _dispatch(self, framed: FramedSocket) -> None:
        """Answer requests in order. Requests already buffered (a pipelining peer) are answered
        together, up to ``_BATCH``, in one scatter-gather send (answers ready before an OFFER,
        whose handler pulls from the writer, are sent before it runs)."""
        event: object = NEED_DATA
        while not self._stop.is_set():
            if event is NEED_DATA:
                event = framed.read(Deadline(self.config.op_timeout_s * 10, framed.peer))
            bufs: list = []
            for _ in range(_BATCH):
                if isinstance(event, ev.ConnectionClosed):
                    break
                if isinstance(event, ev.Offer) and bufs:  # an OFFER may take long: send what is ready first
                    framed.send_buffers(bufs, Deadline(self.config.op_timeout_s, framed.peer))
                    bufs = []
                if isinstance(event, _REQUESTS):  # stray answers are impossible: the Connection rejects them
                    for answer in self._answers(event):
                        bufs += framed.conn.send(answer)
                try:
                    event = framed.conn.next_event()  # no I/O: only what is buffered
                except ProtocolError:
                    if bufs:  # answer what came before the bad frame, then end the connection
                        framed.send_buffers(bufs, Deadline(self.config.op_timeout_s, framed.peer))
                    raise
                if event is NEED_DATA:
                    break
            if bufs:
                framed.send_buffers(bufs, Deadline(self.config.op_timeout_s, framed.peer))
            if isinstance(event, ev.ConnectionClosed):
                return  # else NEED_DATA, or the batch is full and the next request is in hand

    def _answers(self, event) -> list:
        try:
            return list(self.handler(event))
        except TierSyncError as exc:
            code = ev.ErrorCode.BAD_REQUEST if isinstance(exc, ValueError) else ev.ErrorCode.INTERNAL
            return [ev.Error(event.request_id, code, exc.message[:512])]
        except Exception as exc:  # a handler bug must not kill the server
            log.exception("handler failed")
            return [ev.Error(event.request_id, ev.ErrorCode.INTERNAL, type(exc).__name__)]

    def close(self) -> None:
        self._stop.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for framed in conns:
            framed.close()
        self._thread.join(timeout=5)
