"""The answering of sessions' requests on pool workers.

The :class:`Responder` runs the service's handler for a session's request
(:class:`~tiersync.net.server_session.ServerSession`) on a worker, answers the requests a
pipelining peer buffered behind it in the same turn (one send), reads on without waiting while
bytes are already there, then ends it (``end``) when it failed and hands it back (``rearm``):
the server closes a session's socket only once no worker uses it (its number must not go to a
new connection while a worker may still read by it). A request the handler answers
:class:`~tiersync.net.service.Park` parks the session (:mod:`tiersync.net.parking`), neither
handed back nor on a worker, until it is resumed on a worker with that request. Answers its
peer does not take within ``HOLD_S`` (those of a turn, those written before a park or before a
stream begins, and each answer a stream yields: a handler's list holding a pinned DATA or a
Park is answered like one) are held (``hold``): the server watches the socket for room and
:meth:`Responder.write_held` writes on, on a worker, then answers what waited (a stream's
handler is asked for more only once what it yielded was written).
"""

from __future__ import annotations

import inspect
import logging
import ssl
import threading
from collections.abc import Callable, Iterable
from typing import cast

from tiersync.errors import TierSyncError, UsageError
from tiersync.net import events as ev
from tiersync.net.config import TcpConfig
from tiersync.net.errors import ProtocolError
from tiersync.net.parking import ParkedSessions
from tiersync.net.protocol import NEED_DATA, Connection
from tiersync.net.server_session import Rest, ServerSession, Stream, close_rest
from tiersync.net.service import Park, Service
from tiersync.net.socket_io import Deadline

__all__ = ["Responder"]

log = logging.getLogger(__name__)
_BATCH = 16  # most buffered requests answered in one turn (one send)
_TURNS = 16  # turns a worker reads on for one session, then hands it back: a peer that keeps sending
# waits behind the other sessions' turns instead of keeping the worker for as long as it sends
_PARKED = object()  # a turn's end: the session was parked (not handed back)
_HELD = object()  # a turn's end: the peer did not take its answers in time; the rest waits for room


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
        close_rest(event)  # a stream's rest the session ended before: its handler's cleanup runs now
        self._rearm(s)  # handed back: the loop reads it again, or closes its socket once it ended

    def _turn(self, s: ServerSession, event: object) -> object | None:
        """Answer ``event`` and up to ``_BATCH`` requests buffered behind it, in one send; the
        next buffered event (batch full) or None (nothing buffered)."""
        bufs: list[bytes | memoryview] = []
        for _ in range(_BATCH):  # each request's answer gets op_timeout_s from when it was asked for:
            deadline = Deadline(self.config.op_timeout_s, s.peer)  # a handler may wait (a GET for its tensor)
            answered = self._answer(s, event, bufs, deadline)
            if isinstance(answered, Park):  # the answers before it were written
                request = event.request if isinstance(event, Rest) else event
                park = s.first_park(request, answered)
                if park is None:  # waited past its first park's deadline: its late answers
                    answered = self._listed(s, cast(tuple[object, ...], answered.late), [])  # a pinned one copied
                else:
                    self.parked.park(s, request, park)
                    if s.closed:  # ended before it was parked: _end found nothing to resume
                        self.parked.resume(s)
                    return _PARKED
            if answered is _HELD:  # the peer did not take what was written: what waits for it is s.then
                self._hold(s)
                return _HELD
            bufs = cast("list[bytes | memoryview]", answered)
            try:
                with s.lock:
                    event = s.conn.next_event()
            except ProtocolError:
                s.write_or_hold(bufs, deadline)  # answer what came before the bad frame (within HOLD_S), then end
                raise
            if event is not NEED_DATA and isinstance(event, (ev.ConnectionClosed, ev.Error)):
                s.write_or_hold(bufs, deadline)
                self._end(s)
                return None
            if event is NEED_DATA:
                return self._written(s, bufs, deadline, None)
        return self._written(s, bufs, deadline, event)

    def _written(self, s: ServerSession, bufs: list[bytes | memoryview], deadline: Deadline, then: object) -> object:
        """``then`` once a turn's answers are written; ``_HELD`` when the peer did not take them
        within ``HOLD_S``: the rest waits for room without this worker (a peer that stops
        reading must not hold a worker for ``op_timeout_s``), and ``then`` waits with it."""
        if s.write_or_hold(bufs, deadline):
            return then
        s.keep_then(then)
        self._hold(s)
        return _HELD

    def write_held(self, s: ServerSession) -> None:
        """The server saw room on ``s``'s socket: write what is held (again at most ``HOLD_S``),
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
        """``bufs`` with ``event``'s answers (or a held stream's rest's) added; Park (what came
        before it written); or ``_HELD`` when the peer did not take what was written: what waits
        for it is ``s.then`` (the request, asked again from the start, or the stream's rest). A
        handler's list holding a pinned DATA or a Park is answered like a stream."""
        request = event.request if isinstance(event, Rest) else event
        answers = event.answers if isinstance(event, Rest) else self._answers(s, event)
        if isinstance(answers, Park):
            return answers if self._flushed(s, bufs, deadline, request) else _HELD
        if not inspect.isgenerator(answers):
            if not any(map(_one_by_one, answers)):
                return self._listed(s, answers, bufs)
            answers = (a for a in answers)  # answered like a stream's: held, never written on this worker
        stream = cast(Stream, answers)  # its body has not run yet and may wait: what came before goes out first
        return self._streamed(s, request, stream) if self._flushed(s, bufs, deadline, Rest(request, stream)) else _HELD

    def _flushed(self, s: ServerSession, bufs: list[bytes | memoryview], deadline: Deadline, then: object) -> bool:
        """Whether ``bufs`` were written; else they are held, and ``then`` waits for them."""
        if not bufs or s.write_or_hold(bufs, deadline):
            return True
        s.keep_then(then)
        return False

    def _listed(
        self, s: ServerSession, answers: Iterable[object], bufs: list[bytes | memoryview]
    ) -> list[bytes | memoryview]:
        """``bufs`` with the frames of ``answers`` added, to go out in one send (no Park among
        them; a pinned DATA goes by copy: a Park's late answers)."""
        with s.lock:
            for answer in answers:
                bufs += _encode(s.conn, cast(ev.Event, answer))  # the service answers with events
        return bufs

    def _streamed(self, s: ServerSession, request: object, stream: Stream) -> list[bytes | memoryview] | Park | object:
        """A handler that yields may block before its next answer: each answer is sent before
        it is asked for the next; ``_HELD`` when the peer did not take one (asked for more once
        it did)."""
        held = False
        try:
            for answer in stream:
                if isinstance(answer, Park):  # its last answer: the session parks
                    return answer
                pinned = isinstance(answer, ev.Data) and answer.pinned
                with s.lock:
                    bufs = _encode(s.conn, cast(ev.Event, answer))
                if not s.write_or_hold(bufs, Deadline(self.config.op_timeout_s, s.peer), pinned=pinned):
                    s.keep_then(Rest(request, stream))
                    held = True
                    return _HELD
        finally:
            if not held:  # a write failed: the handler's cleanup runs now, not when the traceback goes
                stream.close()
        return []

    def _answers(self, s: ServerSession, event: object) -> Iterable[object] | Park:
        try:
            answers = self.service.handle(s, event)
            if isinstance(answers, Park) or inspect.isgenerator(answers):
                return answers
            listed = list(answers or ())
            return listed[0] if len(listed) == 1 and isinstance(listed[0], Park) else listed  # [Park] is a Park
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


def _one_by_one(answer: object) -> bool:
    """Whether an answer in a handler's list is written alone: a Park (the session parks after
    what came before) or a pinned DATA (by reference, after what came before)."""
    return isinstance(answer, Park) or (isinstance(answer, ev.Data) and answer.pinned)


def _answerable(event: object) -> bool:
    return bool(getattr(event, "request_id", 0))
