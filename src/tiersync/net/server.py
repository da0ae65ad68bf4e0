"""The one server of every link: a selector thread, a connection cap and a bounded worker pool.

One thread accepts, runs TLS and tiersync handshakes and reads idle connections, all
non-blocking: a half-open or idle connection costs a socket and a small
:class:`~tiersync.net.protocol.Connection`, never a thread. Once a session has a complete
request, the session leaves the selector and a pool worker (``TcpConfig.workers``) runs the
service's handler and writes the answers; requests already buffered behind it (a pipelining
peer) are answered in the same turn and sent together, then the session goes back to the
selector. Answers its peer does not take within a second are held: the selector watches its
socket for room and a worker writes on (:mod:`~tiersync.net.responder`), so peers that stop
reading hold no worker; a held session ends at its turn's ``op_timeout_s``. Hostile peers: at ``max_connections`` a new connection ends the oldest one still in
its handshake (silent peers cannot keep a client out), else it is answered ERROR(CAPACITY)
and closed; a handshake not finished within ``connect_timeout_s`` is closed, and so is a
session with a frame begun and not finished within ``op_timeout_s``
(:mod:`~tiersync.net.stalls`); a peer that breaks the protocol is closed; ``accept`` failing
for lack of descriptors pauses accepting for a moment, logs once, and resumes
(:mod:`~tiersync.net.acceptor`); it never ends the server. :meth:`Service.closed` runs
exactly once per opened session, however it ended.
"""

from __future__ import annotations

import itertools
import logging
import queue
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import cast

from tiersync.errors import ClosedError, TierSyncError
from tiersync.net import events as ev
from tiersync.net.acceptor import Acceptor
from tiersync.net.config import TcpConfig, parse_address
from tiersync.net.deadlines import Deadlines
from tiersync.net.errors import ProtocolError
from tiersync.net.handshake import refuse_over_cap
from tiersync.net.protocol import NEED_DATA
from tiersync.net.responder import Responder
from tiersync.net.server_session import ServerSession
from tiersync.net.service import Service
from tiersync.net.socket_io import Deadline, peer_gone, tune, write_nonblocking
from tiersync.net.stalls import Stalls
from tiersync.net.tls import server_context
from tiersync.net.transport import Server

__all__ = ["TcpServer"]

log = logging.getLogger(__name__)
_SCAN_S = 0.5  # how often the peers of parked sessions are looked at (one getsockopt each)
_WRITE_ENDS_S = 1.0  # most the loop waits for a write under way on a socket it closes (shut down: it fails)


class TcpServer(Server):
    """Serves ``service`` on ``address`` ("host:port"; ``.address`` has the bound port)."""

    def __init__(self, address: str, service: Service, config: TcpConfig | None = None) -> None:
        host, port = parse_address(address)
        self.config, self.service = config or TcpConfig(), service
        self._tls = server_context(self.config.tls) if self.config.tls is not None else None
        self._listener = socket.create_server((host, port), backlog=self.config.backlog)
        self._listener.setblocking(False)
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        # (action, session) for the loop thread
        self._todo: queue.SimpleQueue[tuple[str, ServerSession | None]] = queue.SimpleQueue()
        self._sessions: set[ServerSession] = set()
        self._handshakes: Deadlines[ServerSession, None] = Deadlines()  # sessions in their handshake
        self._ids = itertools.count(1)
        self._rbuf = memoryview(bytearray(max(self.config.recv_chunk, 64 << 10)))
        self._workers = ThreadPoolExecutor(self.config.workers, thread_name_prefix=f"tiersync-serve-{port}")
        rearm, hold = (lambda s: self._wake("rearm", s)), (lambda s: self._wake("hold", s))
        self._responder = Responder(
            self.service, self.config, end=self._end, rearm=rearm, submit=self._workers.submit, hold=hold
        )
        self._held: Deadlines[ServerSession, None] = Deadlines()  # sessions whose answers wait for room
        self._scanned_at = 0.0  # when the parked sessions' peers were last looked at
        self._acceptor = Acceptor(self._listener, self._sel, self.address, self._admit, self._evict_pending)
        self._stalls: Stalls[ServerSession] = Stalls(self.config.op_timeout_s)  # frames begun, not finished
        self._stop = threading.Event()
        self.refused = 0
        self._thread = threading.Thread(target=self._loop, name=f"tiersync-server-{self.address}", daemon=True)
        self._thread.start()

    @property
    def connections(self) -> int:
        """Open connections (handshaking ones included)."""
        return len(self._sessions)

    # -- the loop thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                for key, mask in self._sel.select(self._timeout()):
                    if key.fileobj is self._listener:
                        self._acceptor.accept()
                    elif key.fileobj is self._wake_r:
                        self._drain_wake()
                    else:  # a session is registered for reading or (held) for room: mask has one of them
                        self._guarded(self._writable if mask & selectors.EVENT_WRITE else self._readable, key.data)
                self._run_todo()
                self._expire()
        except Exception:  # pragma: no cover - a bug here must not leave the server silently dead
            log.exception("tiersync server loop failed")
        finally:
            self._shutdown()

    def _timeout(self) -> float:
        now = time.monotonic()
        self._acceptor.resume_due(now)
        ends = [self._acceptor.paused_until] if self._acceptor.paused_until else []
        if (first := self._handshakes.first()) is not None:
            ends.append(first[1])
        return max(0.0, min([1.0, *(e - now for e in ends)]))

    def _admit(self, sock: socket.socket, peer: str) -> bool:
        """Take an accepted connection; False when it was refused over the cap."""
        if len(self._sessions) >= self.config.max_connections and not self._evict_pending():
            self.refused += 1
            refuse_over_cap(sock, self.config.max_connections, tls=self._tls is not None)
            return False
        try:
            sock.setblocking(False)
            tune(sock, self.config)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        except OSError:
            sock.close()
            return True
        s = ServerSession(self._end, self.config, self.service.vocabulary, sock, peer, next(self._ids))
        self._sessions.add(s)
        self._handshakes.set(s, time.monotonic() + self.config.connect_timeout_s, None)
        self._register(s)
        return True

    def _register(self, s: ServerSession) -> None:
        if not s.registered and not s.closed:
            self._sel.register(s.sock, selectors.EVENT_READ, s)
            s.registered = True

    def _unregister(self, s: ServerSession) -> None:
        if s.registered:
            self._sel.unregister(s.sock)
            s.registered = False

    def _writable(self, s: ServerSession) -> None:
        """A held session's socket has room (or failed): a worker writes what is held."""
        self._unregister(s)
        self._held.pop(s)
        if s.closed:
            return self._release_socket(s)
        s.busy = True
        self._workers.submit(self._responder.write_held, s)

    def _readable(self, s: ServerSession) -> None:
        if s.closed:  # ended earlier in this round (made room at the cap): not a failed handshake
            return
        if s.tls_pending and not self._tls_handshake(s):
            return
        while True:
            try:
                n = s.sock.recv_into(self._rbuf)
            except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return self._advance(s)
            except OSError as exc:  # ssl.SSLError included
                log.debug("connection from %s failed: %s", s.peer, exc)
                return self._end(s)
            with s.lock:
                s.conn.receive_data(self._rbuf[:n] if n else b"")
            if not n or not (isinstance(s.sock, ssl.SSLSocket) and s.sock.pending()):
                return self._advance(s)  # TLS may hold decrypted bytes the selector cannot see

    def _guarded(self, step: Callable[[ServerSession], None], s: ServerSession) -> None:
        """``step(s)`` on the loop thread; an unexpected error ends that session, never the loop."""
        try:
            step(s)
        except Exception:
            log.exception("connection from %s ended by an unexpected error", s.peer)
            self._end(s)

    def _tls_handshake(self, s: ServerSession) -> bool:
        try:
            cast(ssl.SSLSocket, s.sock).do_handshake()  # tls_pending: an SSLSocket
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return False
        except OSError as exc:
            self._auth_failed(s, f"TLS handshake failed: {getattr(exc, 'reason', None) or exc}")
            return False
        s.tls_pending = False
        return True

    def _advance(self, s: ServerSession) -> None:
        """Handshake events answered here; the first request hands the session to a worker."""
        while not s.closed:
            try:
                with s.lock:
                    event = s.conn.next_event()
            except (ProtocolError, ClosedError) as exc:
                log.debug("connection from %s: %s", s.peer, exc)
                return self._end(s)
            if event is NEED_DATA:
                if s.hs.done:
                    self._stalls.note(s, s.conn.mid_frame, time.monotonic())
                return
            if isinstance(event, ev.ConnectionClosed) or (
                isinstance(event, ev.Error) and (event.request_id == 0 or not s.hs.done)
            ):  # an ERROR before READY, whatever its request id, ends the handshake
                if isinstance(event, ev.Error) and event.code is ev.ErrorCode.AUTH_FAILED and not s.hs.done:
                    return self._auth_failed(s, f"the client refused this server: {event.message}")
                return self._end(s)
            if not s.hs.done:
                self._handshake_step(s, event)
                continue
            self._unregister(s)
            s.busy = True  # the worker reads and writes the socket until it hands it back
            self._stalls.clear(s)
            self._workers.submit(self._responder.work, s, event)
            return

    def _handshake_step(self, s: ServerSession, event: object) -> None:
        try:
            with s.lock:
                bufs = s.hs.step(event)
            write_nonblocking(s.sock, bufs, Deadline(1.0, s.peer))
        except (TierSyncError, OSError):
            return self._end(s)
        if s.hs.failed is not None:
            return self._auth_failed(s, s.hs.failed)
        if s.hs.done:
            assert s.hs.info is not None  # set with done
            self._handshakes.pop(s)
            s.info, s.opened = s.hs.info, True
            try:
                self.service.opened(s)
            except Exception:
                log.exception("service refused a session")
                self._end(s)

    def _auth_failed(self, s: ServerSession, why: str) -> None:
        self.refused += 1
        level = logging.WARNING if self.refused <= 10 or self.refused % 1000 == 0 else logging.DEBUG
        log.log(level, "tiersync server %s refused %s: %s (%d refused so far)", self.address, s.peer, why, self.refused)
        self._end(s)

    def _evict_pending(self, grace_s: float = 0.0) -> bool:
        """At the cap, or out of descriptors: end the oldest connection still in its handshake
        to make room (its socket closes now: handshakes run on this thread); a flood of silent
        peers then mostly cycles among itself: a real client, through its handshake in
        milliseconds, is rarely the oldest. None younger than ``grace_s`` is ended (out of
        descriptors, where the next peer waits in the backlog meanwhile, not refused: else a
        burst of accepts could end a client accepted in that burst). False when none is left."""
        young = time.monotonic() + self.config.connect_timeout_s - min(grace_s, self.config.connect_timeout_s / 2)
        while (first := self._handshakes.first()) is not None and first[1] <= young:
            s = first[0]
            self._handshakes.pop(s)
            if not s.closed:
                log.debug("handshake from %s ended for a newer connection (no room)", s.peer)
                self._end(s)
                return True
        return False

    def _expire(self) -> None:
        now = time.monotonic()
        self._responder.parked.expire(now)
        if now - self._scanned_at >= _SCAN_S:  # a parked session's peer that hung up ends it now
            self._scanned_at = now
            for s in self._responder.parked.sessions():
                if peer_gone(s.sock):
                    self._end(s)
        for s, _ in self._held.due(now):
            log.debug("connection from %s: answers not taken within op_timeout_s", s.peer)
            self._end(s)
        for s in self._stalls.expired(now):
            log.debug("connection from %s: a frame unfinished after op_timeout_s", s.peer)
            self._end(s)
        for s, _ in self._handshakes.due(now):
            if not s.closed:
                log.debug("handshake from %s timed out", s.peer)
                self._end(s)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def _run_todo(self) -> None:
        while True:
            try:
                action, s = self._todo.get_nowait()
            except queue.Empty:
                return
            if s is None:
                continue
            if action == "close":
                if not s.busy:  # else the worker's hand-back releases it
                    self._release_socket(s)
            elif action == "hold" and not s.closed:  # no worker until its socket has room
                s.busy = False
                self._sel.register(s.sock, selectors.EVENT_WRITE, s)
                s.registered = True
                self._held.set(s, time.monotonic() + cast(Deadline, s.held_until).left(), None)
            elif s.closed:  # a worker handed back (or held) a session that ended
                s.busy = False
                self._release_socket(s)
            else:
                s.busy = False
                self._register(s)
                self._guarded(self._advance, s)  # bytes may have arrived while the worker ran

    def _wake(self, action: str, s: ServerSession | None) -> None:
        self._todo.put((action, s))
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass

    # -- ending ----------------------------------------------------------------------------------
    def _end(self, s: ServerSession) -> None:
        """End ``s`` once: tell the service, shut the socket now, release it in the loop thread."""
        if not s.mark_closed():
            return
        if s.opened:
            try:
                self.service.closed(s)
            except Exception:
                log.exception("service failed to release a session")
        try:  # the plain socket's: SSLSocket.shutdown drops its TLS state first, and a worker's
            socket.socket.shutdown(s.sock, socket.SHUT_RDWR)  # send racing it would go out in plaintext
        except OSError:
            pass
        if self._responder.parked.resume(s):  # a worker finds it ended and hands it back
            return
        if threading.current_thread() is not self._thread:
            self._wake("close", s)
        elif not s.busy:
            self._release_socket(s)

    def _release_socket(self, s: ServerSession) -> None:
        """Close the socket once no worker uses it and no write is under way (its number must not
        go to a new connection while another thread may still read or write by it)."""
        s.drop_then()
        self._unregister(s)
        self._stalls.clear(s)
        self._handshakes.pop(s)
        self._held.pop(s)
        self._sessions.discard(s)
        held = s.wlock.acquire(timeout=_WRITE_ENDS_S)  # shut down: a write under way fails at once
        try:
            s.sock.close()
        finally:
            if held:
                s.wlock.release()

    def _shutdown(self) -> None:
        for s in list(self._sessions):
            self._end(s)
        self._run_todo()
        for s in list(self._sessions):  # still with a worker, which was shut out (SHUT_RDWR)
            self._release_socket(s)
        for obj in (self._listener, self._wake_r, self._wake_w):
            obj.close()
        self._sel.close()

    def close(self) -> None:
        """Stop accepting, end every session (the service releases them), join; idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake("stop", None)
        self._thread.join(timeout=10)
        self._workers.shutdown(wait=False, cancel_futures=True)
