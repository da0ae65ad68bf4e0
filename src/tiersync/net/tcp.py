"""TCP transport: tuned sockets, zero-copy scatter-gather I/O, deadlines, token + TLS.

Sockets get SO_SNDBUF/SO_RCVBUF (16 MiB default) and TCP_NODELAY; frames go out gathered and
DATA lands in the caller's buffers through :class:`~tiersync.net.socket_io.FramedSocket`; every
blocking call runs under a deadline (:class:`NetTimeoutError`); :mod:`~tiersync.net.pull_plan` cuts pulls.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, cast

from tiersync.errors import ClosedError, UsageError
from tiersync.net import events as ev
from tiersync.net import store_ops as so
from tiersync.net.config import Route, TcpConfig, parse_address
from tiersync.net.errors import AuthError, NetTimeoutError, PeerClosedError, ProtocolError, ProtocolFault, RequestError
from tiersync.net.frames import PayloadChecksum
from tiersync.net.handshake import client_handshake
from tiersync.net.local import LocalReadError, refusal
from tiersync.net.protocol import Connection, Role
from tiersync.net.pull_plan import Later, local_groups, plan_pulls, writable
from tiersync.net.samehost import local_copy, local_copy_at
from tiersync.net.server import TcpServer
from tiersync.net.service import PeerInfo, Service
from tiersync.net.shared_maps import process_maps
from tiersync.net.socket_io import Deadline, FramedSocket, io_errors, tune
from tiersync.net.socket_owner import not_held
from tiersync.net.tls import client_context
from tiersync.net.transport import Channel, Server, Transport
from tiersync.net.vocab import Vocabulary

if TYPE_CHECKING:
    import numpy as np

__all__ = ["Deadline", "Later", "Route", "TcpChannel", "TcpConfig", "TcpTransport", "parse_address"]

_BROKEN = (PeerClosedError, ProtocolError, NetTimeoutError, AuthError)


class TcpChannel(Channel):
    """Client side of one TCP connection. Use :meth:`TcpTransport.connect` to build."""

    def __init__(self, framed: FramedSocket) -> None:
        self._framed = framed
        self.peer = framed.peer
        self._rlock = threading.Lock()  # reads (receive); request/pull_many take both locks
        self._wlock = threading.Lock()  # writes (send)
        self._ids = itertools.count(1)
        self._closed = False
        self.info = PeerInfo("", "", 0, False)
        """What the server told about itself in the handshake (``same_host`` and its pid)."""
        self._local_failed = False
        self._owner: bool | None = None  # whether the server's pid holds this connection (checked once)
        self._maps = process_maps() if framed.cfg.local_maps else None  # same-host reads: sources' shareable memory

    def handshake(self, deadline: Deadline) -> None:
        """Run HELLO/CHALLENGE/AUTH/READY. Raises AuthError when either side lacks the token."""
        cfg = self._framed.cfg
        token = cast("bytes | None", cfg.token)  # TcpConfig coerced it to bytes
        self.info = client_handshake(self._framed, token, cfg.node_id, deadline)

    def send(self, event: object, *, timeout: float | None = None) -> None:
        """Send one-way message ``event`` (thread-safe beside a :meth:`receive` in another
        thread). Raises like :meth:`request`."""
        self.send_many([event], timeout=timeout)

    def send_many(self, events: Sequence[object], *, timeout: float | None = None) -> None:
        """Send ``events`` (messages, or requests answered through :meth:`next_answer`) in order
        in one write. Raises like :meth:`request`; a refused event (UsageError) closes the
        channel when events before it were counted as sent, else leaves it as it was; any other
        exception (a wire error, a signal handler's mid-write) closes it."""
        with self._wlock:
            self._check_open()
            bufs: list[bytes | memoryview] = []
            try:
                deadline = Deadline(timeout or self._framed.cfg.op_timeout_s, self.peer)
                with self._framed.lock:
                    for event in events:  # messages of this channel's vocabulary
                        bufs += self._framed.conn.send(cast(ev.Event, event))
                self._framed.send_buffers(bufs, deadline)
            except BaseException as exc:  # only a refusal before any event was encoded keeps the channel
                if bufs or not isinstance(exc, UsageError):
                    self.close()
                raise

    def receive(self, *, timeout: float | None = None) -> object:
        """The next one-way message from the server (``timeout`` None: wait for ever).
        PeerClosedError when the connection ended; the channel is closed then."""
        with self._rlock:
            self._check_open()
            try:
                event = self._framed.read(Deadline(timeout if timeout is not None else 1e9, self.peer))
            except _BROKEN:
                self.close()
                raise
            if isinstance(event, (ev.ConnectionClosed, ev.Error)):
                self.close()
                why = getattr(event, "message", "") or "peer closed the connection"
                raise PeerClosedError(why, peer=self.peer)
            return event

    def new_request_id(self) -> int:
        return next(self._ids)

    @property
    def payload_checksum(self) -> PayloadChecksum:
        """The payload checksum negotiated in the handshake."""
        return self._framed.conn.payload_algo

    def request(self, event: object, *, timeout: float | None = None, into: object | None = None) -> object:
        """See :meth:`Channel.request`; ``into`` may also be a list of buffers filled in order."""
        req = cast(ev.Request, event)  # a request of this channel's vocabulary
        with self._rlock, self._wlock:
            self._check_open()
            deadline = Deadline(timeout or self._framed.cfg.op_timeout_s, self.peer)
            with self._framed.lock:
                bufs = self._framed.conn.send(req)  # refused (UsageError): nothing sent, the channel as it was
            try:
                self._framed.send_buffers(bufs, deadline)
                if into is None:
                    return self._answer(req.request_id, deadline)
                self._framed.conn.expect_payload_into(req.request_id, into)
                return self._answer(req.request_id, deadline, data=True)
            except RequestError:
                raise  # the server's ERROR answer: the channel stays usable
            except BaseException:  # a wire error, or anything between a request and its answer
                self.close()  # (a signal handler's exception mid-frame): no torn frame, no stray answer
                raise

    def pull_many(
        self,
        lease_id: int,
        items: Sequence[tuple[bytes, int, memoryview]],
        *,
        window: int = 8,
        timeout: float | None = None,
    ) -> None:
        """Pull ``(key, offset, dest)`` items under ``lease_id``, keeping ``window`` requests in
        flight on this one connection so the round trip of one hides behind the next.

        Each payload lands in its ``dest`` (exact size); items under 4 MiB travel in PULL_MANYs of about
        4 MiB (``GROUP_LIMIT``, within both ends' ``max_frame_size``), each one DATA scattered into their
        buffers. One deadline covers the batch. Raises like :meth:`request` (an ERROR answer raises
        RequestError after the channel is closed: later answers are in flight)."""
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise UsageError("must be >= 1", argument="window", value=window)
        if self.local_route():
            return self._pull_local(lease_id, items, timeout)
        plan = plan_pulls(lease_id, items, self.new_request_id, self._framed.conn.frame_limit)
        self.pipeline(plan, window=window, timeout=timeout)

    def pipeline(
        self,
        requests: Iterable[tuple[ev.Request, object]],
        *,
        window: int = 8,
        timeout: float | None = None,
        idle: float | None = None,
        landed: Callable[[int, object], None] | None = None,
    ) -> None:
        """Send ``(request, destination)`` pairs keeping ``window`` requests in flight. A request with
        a destination (buffer(s) of the exact size, or a :class:`Later` giving them when its answer is
        next) is answered by one DATA landing in place; one with ``None`` by any answer its vocabulary
        allows. ``landed(request_id, answer)`` runs after each answer was received and verified, in
        order (``answer`` None for a landed DATA). One deadline covers the batch; ``idle`` (seconds)
        also bounds each send and each receive of DATA answers (a service's own wait may take until
        the deadline). Raises like :meth:`pull_many` (an exception from ``landed`` closes the channel)."""
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise UsageError("must be >= 1", argument="window", value=window)
        if idle is not None and (isinstance(idle, bool) or not isinstance(idle, (int, float)) or not idle > 0):
            raise UsageError("must be > 0 seconds or None", argument="idle", value=idle)
        with self._rlock, self._wlock:
            self._check_open()
            deadline = Deadline(timeout or self._framed.cfg.op_timeout_s, self.peer)
            todo = iter(requests)
            pending: collections.deque[tuple[int, bool]] = collections.deque()
            later: dict[int, Later] = {}
            try:
                half = max(1, window // 2)
                self._send_pulls(todo, window, pending, later, deadline.within(idle))
                while pending:  # up to half a window landed per native call, then refilled at once
                    self._receive_some(pending, half, later, deadline, idle, landed)
                    if len(pending) <= window - half:
                        self._send_pulls(todo, window - len(pending), pending, later, deadline.within(idle))
            except BaseException:
                self.close()
                raise

    def _receive_some(
        self,
        pending: collections.deque[tuple[int, bool]],
        most: int,
        later: dict[int, Later],
        deadline: Deadline,
        idle: float | None,
        landed: Callable[[int, object], None] | None,
    ) -> None:
        """The answers to the first pending requests: consecutive DATA ones in one native call
        within ``idle`` (the :class:`Later` destinations among them resolved and registered first)."""
        rid, has_dest = pending[0]
        if not has_dest:
            answer = self._answer(rid, deadline)
            pending.popleft()
            if landed is not None:
                landed(rid, answer)
            return
        run = list(itertools.takewhile(lambda p: p[1], itertools.islice(pending, most)))
        for r, _ in run:
            if r in later:
                dest = later.pop(r).resolve()
                with self._framed.lock:
                    self._framed.conn.expect_payload_into(r, dest)
        for _ in range(self._expect_data([r for r, _ in run], deadline.within(idle))):
            rid, _ = pending.popleft()
            if landed is not None:
                landed(rid, None)

    def local_route(self) -> bool:
        """Same-host reads here: the route allows them, the server is on this host (else LOCAL:
        UsageError), the pid it named holds this connection (checked once; else AUTO uses TCP,
        LOCAL raises LocalReadError), and no same-host read was refused (:meth:`local_refused`)."""
        route = self._framed.cfg.route
        if route is Route.LOCAL and not self.info.same_host:
            raise UsageError("route is LOCAL but the server is on another host", argument="route", peer=self.peer)
        if route is Route.TCP or self._local_failed or not self.info.same_host:
            return False
        if self._owner is None:  # a pid on the peer's word could name any process of this user
            self._check_open()  # closed meanwhile: no socket left to ask about (not a refusal)
            self._owner = (refused := not_held(self.info.pid, self._framed.sock, self.peer)) is None
            if refused is not None:
                self.local_refused(refused)
        return self._owner

    def _pull_local(self, lease_id: int, items: Iterable[tuple[bytes, int, object]], timeout: float | None) -> None:
        """PULL_LOCAL, then copy every range out of the server's memory (a map of it where offered,
        else ``process_vm_readv``), verified against the server's checksums; groups grow from
        LOCAL_FIRST to LOCAL_GROUP bytes, the next asked for before this one is copied. On a
        refused read route AUTO falls back to TCP for good, route LOCAL raises."""
        checked = [(key, offset, writable(dest)) for key, offset, dest in items]
        deadline = Deadline(timeout or self._framed.cfg.op_timeout_s, self.peer)
        groups = list(local_groups(checked, self._framed.cfg.protocol.max_keys, self._framed.conn.frame_limit))
        asked: list[int] = []
        for i, group in enumerate(groups):
            while len(asked) < min(i + 2, len(groups)):
                wanted = tuple((k, o, len(v)) for k, o, v in groups[len(asked)])
                asked.append((req := so.PullLocal(self.new_request_id(), lease_id, wanted)).request_id)
                self.send(req, timeout=deadline.remaining())
            try:
                self.local_copy(self.next_answer(asked[i], timeout=deadline.remaining()), [v for _, _, v in group])
            except (LocalReadError, RequestError) as exc:
                refused = refusal(exc, self.peer)
                if refused is None:
                    if asked[i + 1 :]:  # answers still in flight nobody would read
                        self.close()
                    raise
                for rid in asked[i + 1 :]:  # answers still in flight (refused too, or not)
                    with contextlib.suppress(RequestError):
                        self.next_answer(rid, timeout=deadline.remaining())
                self.local_refused(refused)
                return self.pull_many(lease_id, [x for g in groups[i:] for x in g], timeout=deadline.remaining())
        return None

    def local_copy(self, reply: object, dests: list[memoryview]) -> None:
        """Land a LOCAL_REPLY (naming the pid :meth:`local_route` checked) in ``dests``, verified."""
        local_copy(reply, dests, self.peer, self._framed.cfg.local_threads, self._maps, self.info.pid)

    def local_copy_at(self, reply: object, dest: np.ndarray, offsets: np.ndarray) -> None:
        """:meth:`local_copy` into one uint8 array, region ``i`` at ``dest[offsets[i]:]``."""
        local_copy_at(reply, dest, offsets, self.peer, self._framed.cfg.local_threads, self._maps, self.info.pid)

    @property
    def mapped_sources(self) -> int:
        """Maps of this channel's server's memory open now (this process's channels share them)."""
        return self._maps.count(self.info.pid) if self._maps is not None and self.info.pid is not None else 0

    def local_refused(self, exc: LocalReadError) -> None:
        """A same-host read was refused (permissions, another pid namespace): route AUTO uses
        TCP on this channel from now on; route LOCAL raises ``exc``."""
        if self._framed.cfg.route is Route.LOCAL:
            raise exc
        self._local_failed = True

    def _send_pulls(
        self,
        todo: Iterator[tuple[ev.Request, object]],
        n: int,
        pending: collections.deque[tuple[int, bool]],
        later: dict[int, Later],
        deadline: Deadline,
    ) -> None:
        """Encode up to ``n`` more requests from ``todo``, register their buffers (reserve the
        places of :class:`Later` ones), send them in one go."""
        conn = self._framed.conn
        bufs: list[bytes | memoryview] = []
        with self._framed.lock:
            for request, dest in itertools.islice(todo, n):
                bufs += conn.send(request)
                if isinstance(dest, Later):
                    conn.expect_payload_later(request.request_id)
                    later[request.request_id] = dest
                elif dest is not None:
                    conn.expect_payload_into(request.request_id, dest)
                pending.append((request.request_id, dest is not None))
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
        with self._rlock, self._wlock:
            self._check_open()
            try:
                return self._answer(request_id, Deadline(timeout or self._framed.cfg.op_timeout_s, self.peer))
            except _BROKEN:
                self.close()
                raise

    def _answer(self, request_id: int, deadline: Deadline, *, data: bool = False) -> object:
        """The next event as the answer to ``request_id`` (``data``: a DATA into a registered buffer)."""
        event = self._framed.read_data([request_id], deadline)[0] if data else self._framed.read(deadline)
        return self._check_answer(request_id, event)

    def _check_answer(self, request_id: int, event: object) -> object:
        if isinstance(event, ev.ConnectionClosed):
            raise PeerClosedError("peer closed the connection", peer=self.peer)
        if isinstance(event, ev.Error) and event.request_id == 0:
            raise PeerClosedError(f"peer ended the connection: {event.message}", peer=self.peer)
        if getattr(event, "request_id", None) != request_id:  # a request, or the ERROR of another request
            why = "peer sent a request on a client channel" if not isinstance(event, ev.Error) else "out-of-turn ERROR"
            raise ProtocolError(why, fault=ProtocolFault.UNEXPECTED, peer=self.peer, request_id=request_id)
        if isinstance(event, ev.Error):
            raise RequestError(event.message or "request failed", code=event.code, peer=self.peer)
        return event

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("channel closed", peer=self.peer)

    def close(self) -> None:
        """Close now; a request running in another thread fails with PeerClosedError."""
        if not self._closed:
            self._closed = True
            self._framed.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def reusable(self) -> bool:
        """Open, and the peer neither sent anything nor hung up while it sat idle in a pool."""
        return not self._closed and self._framed.quiet()


class TcpTransport(Transport):
    """Connects and serves over TCP with ``config``, speaking ``vocabulary`` (default: the
    block store's)."""

    def __init__(self, config: TcpConfig | None = None, vocabulary: Vocabulary | None = None) -> None:
        self.config = config or TcpConfig()
        self.vocabulary = vocabulary if vocabulary is not None else so.STORE

    def connect(self, address: str, *, timeout: float | None = None) -> TcpChannel:
        host, port = parse_address(address)
        deadline = Deadline(timeout or self.config.connect_timeout_s, address)
        with io_errors(address):
            source = None if self.config.source_ip is None else (self.config.source_ip, 0)
            sock = socket.create_connection((host, port), timeout=deadline.remaining(), source_address=source)
        try:
            tune(sock, self.config)
            sock = self._wrap_tls(sock, host, deadline, address)
            conn = Connection(Role.CLIENT, self.config.protocol, self.vocabulary)
            channel = TcpChannel(FramedSocket(sock, conn, address, self.config))
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

    def serve(self, address: str, service: Service) -> Server:
        return TcpServer(address, service, self.config)
