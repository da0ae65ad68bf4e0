"""Server sessions and the answering of their requests on pool workers.

A :class:`ServerSession` is one accepted connection; the :class:`Responder` runs the service's
handler for a session's request on a worker, answers the requests a pipelining peer buffered
behind it in the same turn (one send), reads on without waiting while bytes are already there,
then ends it (``end``) when it failed and hands it back (``rearm``): the server closes a
session's socket only once no worker uses it (its number must not go to a new connection
while a worker may still read by it). A request the handler answers
:class:`~tiersync.net.service.Park` parks the session (:mod:`tiersync.net.parking`), neither
handed back nor on a worker, until it is resumed on a worker with that request. A turn's
answers its peer does not take within ``_HOLD_S`` are held (``hold``): the server watches the
socket for room and :meth:`Responder.write_held` writes on, on a worker (plain TCP and TLS). A
streamed answer's handler is asked for more once what it yielded was written (:class:`_Rest`),
or closed if the session ends first. Other writes to a session with held answers queue behind
them up to ``_QUEUED`` bytes, then wait.
"""

from __future__ import annotations

import inspect
import logging
import socket
import ssl
import threading
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import cast

from tiersync.errors import ClosedError, TierSyncError, UsageError
from tiersync.net import events as ev
from tiersync.net.config import ByReference, TcpConfig
from tiersync.net.errors import NetTimeoutError, ProtocolError
from tiersync.net.handshake import ServerHandshake
from tiersync.net.local import local_address
from tiersync.net.parking import ParkedSessions
from tiersync.net.protocol import NEED_DATA, Connection, Role
from tiersync.net.service import Park, PeerInfo, Service, Session
from tiersync.net.socket_io import Deadline, peer_ip, write_nonblocking, write_within
from tiersync.net.vocab import Vocabulary

__all__ = ["Responder", "ServerSession", "by_reference"]

log = logging.getLogger(__name__)
_BATCH = 16  # most buffered requests answered in one turn (one send)
_TURNS = 16  # turns a worker reads on for one session, then hands it back: a peer that keeps sending
# waits behind the other sessions' turns instead of keeping the worker for as long as it sends
_PARKED = object()  # a turn's end: the session was parked (not handed back)
_HELD = object()  # a turn's end: the peer did not take its answers in time; the rest waits for room
_HOLD_S = 1.0  # most a worker waits for a peer to take a turn's answers before the rest waits without it
_QUEUED = 1 << 20  # most bytes of other writes queued behind held answers; a write past it waits for room
_Stream = Generator[object, None, None]  # a handler's answers, yielded one by one


@dataclass(frozen=True, slots=True)
class _Rest:
    """A streamed answer's rest: ``answers`` (the handler's generator) of ``request``, held
    after an answer its peer did not take, and asked for more once that was written."""

    request: object
    answers: _Stream


def by_reference(mode: ByReference, peer_ip: str) -> bool:
    """Whether pinned DATA to a peer at ``peer_ip`` goes by reference (see :class:`ByReference`)."""
    return mode is ByReference.ALWAYS or (mode is ByReference.AUTO and not local_address(peer_ip))


class ServerSession(Session):
    """One connection of a :class:`~tiersync.net.server.TcpServer` (see :class:`Session`);
    ``end`` is the server's way to end it (once)."""

    def __init__(
        self,
        end: Callable[[ServerSession], None],
        config: TcpConfig,
        vocabulary: Vocabulary,
        sock: socket.socket,
        peer: str,
        session_id: int,
    ) -> None:
        self._end, self._config, self.sock, self.peer, self.session_id = end, config, sock, peer, session_id
        self.conn = Connection(Role.SERVER, config.protocol, vocabulary)
        token = cast("bytes | None", config.token)  # TcpConfig coerced it to bytes
        self.hs = ServerHandshake(self.conn, token, session_id, peer_ip(sock))
        self.info = PeerInfo("", "", 0, False)
        self.lock = threading.Lock()  # the Connection's state
        self.wlock = threading.Lock()  # writes to the socket
        self._drained = threading.Condition(self.wlock)  # what was held is written
        self.tls_pending = isinstance(sock, ssl.SSLSocket)
        self.registered = False  # in the selector (loop thread only)
        self.busy = False  # a worker uses the socket (loop thread only: set on hand-out, cleared on hand-back or hold)
        self._by_reference: bool | None = None  # known at the first pinned write
        self.opened = False
        self._closed = False
        self.held: list[memoryview] = []  # answers the peer has not taken yet, written once it has room
        self.held_until: Deadline | None = None  # ... by then, else the session ends
        self._queued = 0  # bytes of writes queued behind held answers
        self.then: object | None = None  # the request (or a _Rest) to answer once they are written

    def send(self, event: object, *, timeout: float | None = None) -> None:
        if self._closed:
            raise ClosedError("session closed", peer=self.peer)
        with self.lock:
            bufs = self.conn.send(cast(ev.Event, event))  # an event of the session's vocabulary
        self.write(bufs, Deadline(timeout or self._config.op_timeout_s, self.peer))

    def write(self, bufs: list[bytes | memoryview], deadline: Deadline, *, pinned: bool = False) -> None:
        """Write ``bufs`` whole before ``deadline``, the wait for another writer of this session
        included (one stuck on a peer that does not read must not hold every other sender past
        its own deadline); any failure ends the session. While answers are :attr:`held`, ``bufs``
        are queued behind them instead (written with them, or the session ends at their
        ``held_until``), up to ``_QUEUED`` bytes; past that the write waits (by ``deadline``)
        until the held answers are written. ``pinned``: see
        :func:`~tiersync.net.socket_io.write_nonblocking`."""
        try:
            if not self.wlock.acquire(timeout=deadline.remaining()):
                raise NetTimeoutError("another write to this peer did not end in time", peer=self.peer)
            try:
                nbytes = sum(memoryview(b).nbytes for b in bufs)
                while self.held and self._queued + nbytes > _QUEUED:
                    if self._closed:
                        raise ClosedError("session closed", peer=self.peer)
                    self._drained.wait(min(deadline.remaining(), _HOLD_S))  # raises once it passed
                if self.held:  # behind answers waiting for room: written with them
                    self.held += [memoryview(b).cast("B") for b in bufs]
                    self._queued += nbytes
                    return
                write_nonblocking(self.sock, bufs, deadline, pinned=pinned and self._pinned_by_reference())
            finally:
                self.wlock.release()
        except (TierSyncError, OSError):
            self.close()
            raise

    def write_or_hold(self, bufs: list[bytes | memoryview], deadline: Deadline, *, pinned: bool = False) -> bool:
        """Write ``bufs`` (answers, with what is held before them), waiting at most ``_HOLD_S``
        for room; False when the peer did not take them all: the rest is :attr:`held`, to be
        written by ``deadline`` once the socket has room (the caller frees its worker
        meanwhile). A TLS write cut short is retried with the same buffer, as OpenSSL requires.
        ``pinned``: as for :meth:`write` (what is held later goes by copy). Any failure ends the
        session."""
        try:
            hold = deadline.within(_HOLD_S)
            if not self.wlock.acquire(timeout=hold.remaining()):
                raise NetTimeoutError("another write to this peer did not end in time", peer=self.peer)
            try:
                by_ref = pinned and self._pinned_by_reference()
                self.held = write_within(self.sock, [*self.held, *bufs], hold, pinned=by_ref)
                self.held_until = deadline if self.held else None
                if self.held:
                    deadline.remaining()  # the deadline itself passed: raises
                    return False
                self._queued = 0
                self._drained.notify_all()
                return True
            finally:
                self.wlock.release()
        except (TierSyncError, OSError):
            self.close()
            raise

    def _pinned_by_reference(self) -> bool:
        """Whether this session's pinned DATA goes by reference (:class:`ByReference`)."""
        if self._by_reference is None:
            self._by_reference = by_reference(self._config.by_reference, self.hs.peer_ip)
        return self._by_reference

    def close(self) -> None:
        self._end(self)

    def take_then(self) -> object | None:
        """What waits for the held answers, taken once (by their writer, or by :meth:`drop_then`)."""
        with self.lock:
            then, self.then = self.then, None
        return then

    def drop_then(self) -> None:
        """The session ended: a streamed answer's handler that waited is closed (its cleanup runs)."""
        if isinstance(then := self.take_then(), _Rest):
            try:
                then.answers.close()
            except Exception:  # a handler's cleanup that failed: logged, the server goes on
                log.exception("closing a held answer's handler failed")

    @property
    def closed(self) -> bool:
        return self._closed

    def mark_closed(self) -> bool:
        """Mark the session ended; False when it already was (the server ends it once)."""
        with self.lock:
            if self._closed:
                return False
            self._closed = True
            return True


class Responder:
    """Answers sessions' requests with ``service`` on pool workers (see the module doc)."""

    def __init__(
        self,
        service: Service,
        config: TcpConfig,
        *,
        end: Callable[[ServerSession], None],
        rearm: Callable[[ServerSession], None],
        submit: Callable[..., object],
        hold: Callable[[ServerSession], None],
    ) -> None:
        """``submit(fn, *args)`` runs ``fn(*args)`` on a pool worker (a parked session's
        resumption); ``hold(s)``: ``s`` has answers :attr:`ServerSession.held`: the server calls
        :meth:`write_held` once its socket has room, or ends it at ``held_until``."""
        self.service, self.config, self._end, self._rearm, self._submit = service, config, end, rearm, submit
        self._hold = hold
        self.parked: ParkedSessions[ServerSession] = ParkedSessions(self._resumed)

    def _resumed(self, s: ServerSession, event: object) -> None:
        """A parked session back to a worker; with none to take it, ended and handed back."""
        try:
            self._submit(self.work, s, event)
        except RuntimeError:  # the pool shut down (the server closes), or no thread could start
            self._end(s)
            self._rearm(s)

    def work(self, s: ServerSession, event: object) -> None:
        """Answer ``event`` and what follows it on ``s`` (a pool worker runs this)."""
        try:
            turns = 0
            while event is not None and not s.closed:
                event, turns = self._turn(s, event), turns + 1
                if event is _PARKED or event is _HELD:  # another worker goes on when it is resumed
                    return
                if event is None and turns < _TURNS:  # a pipelining peer's next requests are often here already
                    event = self._more(s)
        except (TierSyncError, OSError) as exc:
            log.debug("session %s ended: %s", s.peer, exc)
            self._end(s)
        except Exception:  # a bug (or a peer's input no parser foresaw): this session ends, not the server
            log.exception("session %s ended by an unexpected error", s.peer)
            self._end(s)
        self._rearm(s)  # handed back: the loop reads it again, or closes its socket once it ended

    def _turn(self, s: ServerSession, event: object) -> object | None:
        """Answer ``event`` and up to ``_BATCH`` requests buffered behind it, in one send; the
        next buffered event (batch full) or None (nothing buffered)."""
        bufs: list[bytes | memoryview] = []
        for _ in range(_BATCH):  # each request's answer gets op_timeout_s from when it was asked for:
            deadline = Deadline(self.config.op_timeout_s, s.peer)  # a handler may wait (a GET for its tensor)
            answered = self._answer(s, event, bufs, deadline)
            if isinstance(answered, Park):  # the answers before it were written
                self.parked.park(s, event.request if isinstance(event, _Rest) else event, answered)
                if s.closed:  # ended before it was parked: _end found nothing to resume
                    self.parked.resume(s)
                return _PARKED
            if answered is _HELD:  # a streamed answer the peer did not take: the rest is s.then
                self._hold(s)
                return _HELD
            bufs = cast("list[bytes | memoryview]", answered)
            try:
                with s.lock:
                    event = s.conn.next_event()
            except ProtocolError:
                s.write(bufs, deadline)  # answer what came before the bad frame, then end
                raise
            if event is not NEED_DATA and isinstance(event, (ev.ConnectionClosed, ev.Error)):
                s.write(bufs, deadline)
                self._end(s)
                return None
            if event is NEED_DATA:
                return self._written(s, bufs, deadline, None)
        return self._written(s, bufs, deadline, event)

    def _written(self, s: ServerSession, bufs: list[bytes | memoryview], deadline: Deadline, then: object) -> object:
        """``then`` once a turn's answers are written; ``_HELD`` when the peer did not take them
        within ``_HOLD_S``: the rest waits for room without this worker (a peer that stops
        reading must not hold a worker for ``op_timeout_s``), and ``then`` waits with it."""
        if s.write_or_hold(bufs, deadline):
            return then
        s.then = then
        self._hold(s)
        return _HELD

    def write_held(self, s: ServerSession) -> None:
        """The server saw room on ``s``'s socket: write what is held (again at most ``_HOLD_S``),
        then answer on (a pool worker runs this)."""
        try:
            if not s.closed and (s.held_until is None or s.write_or_hold([], s.held_until)):
                return self.work(s, s.take_then())  # hands the session back
            if not s.closed:
                return self._hold(s)
        except (TierSyncError, OSError) as exc:
            log.debug("session %s ended: %s", s.peer, exc)
            self._end(s)
        except Exception:  # a bug: this session ends, not the server
            log.exception("session %s ended by an unexpected error", s.peer)
            self._end(s)
        self._rearm(s)

    def _more(self, s: ServerSession) -> object | None:
        """Without waiting: the next request if its bytes are already here (read on this worker,
        so a busy session does not go back through the selector between turns), else None."""
        if isinstance(s.sock, ssl.SSLSocket):
            return None
        buf = _worker_buffer()
        try:
            n = s.sock.recv_into(buf)
        except (BlockingIOError, InterruptedError):
            return None
        with s.lock:
            s.conn.receive_data(buf[:n] if n else b"")
            event = s.conn.next_event()
        if isinstance(event, ev.ConnectionClosed) or (isinstance(event, ev.Error) and event.request_id == 0):
            self._end(s)
            return None
        return None if event is NEED_DATA else event

    def _answer(
        self, s: ServerSession, event: object, bufs: list[bytes | memoryview], deadline: Deadline
    ) -> list[bytes | memoryview] | Park | object:
        """``bufs`` with ``event``'s answers (or those of a held stream's rest) added; Park; or
        ``_HELD`` when a streamed answer waits for room (its rest is ``s.then``)."""
        answers = event.answers if isinstance(event, _Rest) else self._answers(s, event)
        if isinstance(answers, Park):
            if bufs:
                s.write(bufs, deadline)
            return answers
        streamed = inspect.isgenerator(answers)
        if streamed and bufs:  # its body has not run yet and may wait: earlier answers go out first
            s.write(bufs, deadline)
            bufs = []
        held = False
        try:
            for answer in answers:
                if isinstance(answer, Park):  # its last answer: the session parks after the ones before
                    if bufs:
                        s.write(bufs, deadline)
                    return answer
                pinned = isinstance(answer, ev.Data) and answer.pinned
                if pinned and bufs:  # what came before it goes by copy
                    s.write(bufs, deadline)
                    bufs = []
                with s.lock:
                    bufs += _encode(s.conn, cast(ev.Event, answer))  # the service answers with events
                if streamed:  # a handler that yields may block before its next answer: send this one now
                    if not s.write_or_hold(bufs, Deadline(self.config.op_timeout_s, s.peer), pinned=pinned):
                        rest = _Rest(event.request if isinstance(event, _Rest) else event, cast(_Stream, answers))
                        s.then, held = rest, True
                        return _HELD  # asked for more once the peer took this one
                    bufs = []
                elif pinned:  # a handler that does not stream (none in tiersync): on the worker
                    s.write(bufs, deadline, pinned=True)
                    bufs = []
        finally:
            if streamed and not held:  # a write failed: the handler's cleanup runs now, not when the traceback goes
                cast(_Stream, answers).close()
        return bufs

    def _answers(self, s: ServerSession, event: object) -> Iterable[object] | Park:
        try:
            answers = self.service.handle(s, event)
            return answers if isinstance(answers, Park) or inspect.isgenerator(answers) else list(answers or ())
        except TierSyncError as exc:
            code = ev.ErrorCode.BAD_REQUEST if isinstance(exc, ValueError) else ev.ErrorCode.INTERNAL
            return [ev.Error(getattr(event, "request_id", 0), code, exc.message[:512])] if _answerable(event) else []
        except Exception as exc:
            log.exception("handler failed")
            return (
                [ev.Error(getattr(event, "request_id", 0), ev.ErrorCode.INTERNAL, type(exc).__name__)]
                if _answerable(event)
                else []
            )


def _encode(conn: Connection, answer: ev.Event) -> list[bytes | memoryview]:
    """``answer``'s frames; a DATA the connection refuses (UsageError: larger than the client
    accepts) goes out as an ERROR to its request instead (nothing of it was sent; a DATA is its
    request's last answer). Any other refused answer raises: the session ends (and its leases
    with it)."""
    try:
        return conn.send(answer)
    except UsageError as exc:
        if not isinstance(answer, ev.Data):
            raise
        return conn.send(ev.Error(answer.request_id, ev.ErrorCode.BAD_REQUEST, exc.message[:512]))


_local = threading.local()


def _worker_buffer() -> memoryview:
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = memoryview(bytearray(256 << 10))
    return buf


def _answerable(event: object) -> bool:
    return bool(getattr(event, "request_id", 0))
