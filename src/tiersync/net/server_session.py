"""One accepted connection of the server, :class:`ServerSession`: its handshake and protocol
state, and its writes.

Writes of one session are serialized (``wlock``), each within its own deadline. Answers its
peer does not take within ``HOLD_S`` are :attr:`~ServerSession.held` on the session while the
server watches the socket for room (:meth:`ServerSession.write_or_hold`; a TLS write cut short
is retried with the same buffer, as OpenSSL requires). Other writes (a publisher's ANNOUNCE)
queue behind held answers up to ``QUEUED`` bytes, then wait for them. What waits for the held
answers, the next request or the rest of a streamed answer (:class:`Rest`), is kept on the
session (``then``); a stream's handler is closed, so its cleanup runs, if the session ends first.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import cast

from tiersync.errors import ClosedError, TierSyncError
from tiersync.net import events as ev
from tiersync.net.config import ByReference, TcpConfig
from tiersync.net.errors import NetTimeoutError
from tiersync.net.handshake import ServerHandshake
from tiersync.net.local import local_address
from tiersync.net.protocol import Connection, Role
from tiersync.net.service import Park, PeerInfo, Session
from tiersync.net.socket_io import Deadline, peer_ip, write_nonblocking, write_within
from tiersync.net.vocab import Vocabulary

__all__ = ["HOLD_S", "QUEUED", "Rest", "ServerSession", "by_reference", "close_rest"]

log = logging.getLogger(__name__)
HOLD_S = 1.0  # most a worker waits for a peer to take answers before the rest waits without it
QUEUED = 1 << 20  # most bytes of other writes queued behind held answers; a write past it waits for room
Stream = Generator[object, None, None]  # a handler's answers, yielded one by one


@dataclass(frozen=True, slots=True)
class Rest:
    """A streamed answer's rest: ``answers`` (the handler's generator) of ``request``, kept
    while what was written before it (its last answer, or the answers before the stream began)
    waits for room, and asked for more once that was written."""

    request: object
    answers: Stream


def close_rest(then: object) -> None:
    """Close ``then``'s handler if it is a :class:`Rest` (its cleanup runs now; a failure is logged)."""
    if isinstance(then, Rest):
        try:
            then.answers.close()
        except Exception:  # a handler's cleanup that failed: logged, the server goes on
            log.exception("closing a held answer's handler failed")


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
        self._first_park: tuple[object, float] | None = None  # (request, deadline) of its first park
        self.then: object | None = None  # the request (or a Rest) to answer once they are written

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
        ``held_until``), up to ``QUEUED`` bytes; past that the write waits (by ``deadline``)
        until the held answers are written. ``pinned``: see
        :func:`~tiersync.net.socket_io.write_nonblocking`."""
        with self._writing(deadline):
            nbytes = sum(memoryview(b).nbytes for b in bufs)
            while self.held and self._queued + nbytes > QUEUED:
                if self._closed:
                    raise ClosedError("session closed", peer=self.peer)
                self._drained.wait(min(deadline.remaining(), HOLD_S))  # raises once it passed
            if self.held:  # behind answers waiting for room: written with them
                self.held += [memoryview(b).cast("B") for b in bufs]
                self._queued += nbytes
                return
            write_nonblocking(self.sock, bufs, deadline, pinned=pinned and self._pinned_by_reference())

    def write_or_hold(self, bufs: list[bytes | memoryview], deadline: Deadline, *, pinned: bool = False) -> bool:
        """Write ``bufs`` (answers, with what is held before them), waiting at most ``HOLD_S``
        for room; False when the peer did not take them all: the rest is :attr:`held`, to be
        written by ``deadline`` once the socket has room (the caller frees its worker
        meanwhile). A TLS write cut short is retried with the same buffer, as OpenSSL requires.
        ``pinned``: as for :meth:`write` (what is held later goes by copy). Any failure ends the
        session."""
        with self._writing(deadline, HOLD_S) as hold:
            by_ref = pinned and self._pinned_by_reference()
            self.held = write_within(self.sock, [*self.held, *bufs], hold, pinned=by_ref)
            self.held_until = deadline if self.held else None
            if self.held:
                deadline.remaining()  # the deadline itself passed: raises
                return False
            self._queued = 0
            self._drained.notify_all()
            return True

    @contextlib.contextmanager
    def _writing(self, deadline: Deadline, within_s: float | None = None) -> Iterator[Deadline]:
        """The write lock, waited for until ``deadline`` or, given ``within_s``, at most that many
        seconds of it (the deadline yielded), so a writer stuck on a peer that does not read
        holds no other one past its own; any failure, a deadline that passed too, ends the session."""
        try:
            limit = deadline if within_s is None else deadline.within(within_s)
            if not self.wlock.acquire(timeout=limit.remaining()):
                raise NetTimeoutError("another write to this peer did not end in time", peer=self.peer)
            try:
                yield limit
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

    def first_park(self, request: object, park: Park) -> Park | None:
        """``park`` of ``request`` (a worker's only), with the deadline of the request's first
        park when it has :attr:`Park.late` answers; None once that passed."""
        if park.late is None:
            return park
        first = self._first_park
        if first is None or first[0] is not request:
            first = self._first_park = (request, park.deadline)
        if time.monotonic() >= first[1]:
            self._first_park = None
            return None
        return park if park.deadline == first[1] else Park(park.watch, first[1], park.late)

    def keep_then(self, then: object) -> None:
        """Keep what waits for the held answers (a request, or a :class:`Rest`); a stream's
        handler is closed instead when the session already ended (nothing would drop it)."""
        with self.lock:
            if not self._closed:
                self.then = then
                return
        close_rest(then)

    def take_then(self) -> object | None:
        """What waits for the held answers, taken once (by their writer, or by :meth:`drop_then`)."""
        with self.lock:
            then, self.then = self.then, None
        return then

    def drop_then(self) -> None:
        """The session ended: a streamed answer's handler that waited is closed (its cleanup runs)."""
        close_rest(self.take_then())

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
