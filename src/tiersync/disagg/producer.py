"""Prefill side: serve a request's KV to the decode ranks, layer by layer, over TCP.

One :class:`KVProducer` per prefill rank. Typical use from an engine connector::

    producer = KVProducer(layout, rank=tp_rank, config=DisaggConfig(token=secret))
    producer.register(req_id, block_ids, num_tokens, host_layers)   # before the forward pass
    ...  # per layer, after its D2H copy into host_layers[l] completed:
    producer.layer_ready(req_id, l)
    ...  # every engine step:
    status = producer.poll()   # done_sending / failed_sending: free the request's blocks

Decode ranks connect (token, TLS: :class:`~tiersync.net.server.TcpServer`), open the request
with their layout and block ids (KV_OPEN, :mod:`tiersync.disagg.ops`); the producer plans
(:mod:`tiersync.disagg.reshard`), then answers KV_NEXT with each layer as soon as it is ready,
KV_PULL with its route bytes (views of the host buffer, or gathered when the route is many
small spans), KV_PULL_LOCAL (same host) with where they are, and KV_DONE with whether the
reader was counted. The request is DONE when every destination rank that reads from this rank
acknowledged; FAILED when ``config.timeout_s`` after :meth:`register` passes first, when a reader
fails or disconnects, on :meth:`abort`, or on a KV_DROP (a decode scheduler's or a failed read's).
Unknown requests are refused (ERROR ``unknown_request``): register before a decode side learns of one.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

from tiersync.disagg.config import DisaggConfig, FinishedRequests, RequestState, check_side
from tiersync.disagg.geometry import PagedKVLayout
from tiersync.disagg.layer_reads import LayerReads, Outgoing, Refused, Route
from tiersync.disagg.messages import ReadRequest, check_request_id
from tiersync.disagg.ops import KV, KvDone, KvDrop, KvLayer, KvNext, KvOpen, KvOpened, KvPull, KvPullLocal
from tiersync.disagg.reshard import ReshardPlanner, block_table, default_planner, route_digest
from tiersync.disagg.spanio import byte_view
from tiersync.errors import ClosedError, UsageError, check_positive_int
from tiersync.net import events as ev
from tiersync.net.server import TcpServer
from tiersync.net.service import Park, Service, Session
from tiersync.tiers.shareable import SharedRegion, check_shared

__all__ = ["KVProducer"]

_FORGET_AFTER = 4096  # final request ids remembered so a late layer_ready is a no-op
_DROPPED = {True: (ev.CommitStatus.COMMITTED, ""), False: (ev.CommitStatus.FAILED, "unknown, final or being read")}
Code = ev.ErrorCode


class KVProducer(Service):
    """Serves registered requests on ``host:port`` (``port=0``: any free port, see
    :attr:`address`). ``layout`` is this TP group's geometry; ``rank`` this process's rank in
    it. ``shared``: the layer buffers' memory same-host readers may map
    (:func:`~tiersync.tiers.shareable.share_in_place`; they copy the rest with
    ``process_vm_readv``). Thread-safe; close with :meth:`close` (or use as a context manager)."""

    vocabulary = KV

    def __init__(
        self,
        layout: PagedKVLayout,
        rank: int,
        config: DisaggConfig | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        planner: ReshardPlanner | None = None,
        shared: Iterable[SharedRegion] = (),
    ) -> None:
        self.config = check_side(layout, rank, config)
        self.layout, self.rank = layout, rank
        self._planner = planner or default_planner()
        self._lock = threading.Lock()
        self._requests: dict[str, Outgoing] = {}
        self._final: OrderedDict[str, RequestState] = OrderedDict()
        self._unreported: list[tuple[str, RequestState]] = []
        self._progress = threading.Event()  # set when a request became final since the last poll
        self._closed = threading.Event()
        self._routes: dict[int, Route] = {}  # session id -> its open request
        self._reads = LayerReads(layout, self.config, check_shared(shared))
        self._sums = self._reads.sums
        self._server = TcpServer(f"{host}:{port}", self, self.config.tcp_config(server=True))
        self.address = self._server.address

    # -- caller API --------------------------------------------------------------------------
    def register(self, request_id: str, block_ids: Sequence[int], num_tokens: int, layers: Sequence[Any]) -> None:
        """Offer a request: its ``block_ids`` (block table in this rank's layer buffers), token
        count, and ``layers[l]`` = layer ``l``'s host buffer (C-contiguous, exactly
        ``layout.layer_nbytes``; numpy array, bytearray, mmap, ``torch_cpu_tensor.numpy()``).
        Requests may share the same buffers (a host pool per layer) with distinct block ids.
        Buffers are read from :meth:`layer_ready` on until the request is reported by
        :meth:`poll`. The deadline (``config.timeout_s``) starts now. All-or-nothing; raises
        UsageError naming ``request_id`` (bad or already registered), ``block_ids``,
        ``num_tokens`` or ``layers[i]``; ClosedError after :meth:`close`."""
        self._check_open()
        check_request_id(request_id)
        check_positive_int(num_tokens, "num_tokens")
        table = tuple(block_table(block_ids, self.layout, num_tokens, "block_ids").tolist())
        if isinstance(layers, (str, bytes)) or len(layers) != self.layout.num_layers:
            raise UsageError("needs one host buffer per layer", argument="layers", expected=self.layout.num_layers)
        n = self.layout.layer_nbytes
        views = [byte_view(b, n, writable=False, argument=f"layers[{i}]") for i, b in enumerate(layers)]
        with self._lock:
            if request_id in self._requests or request_id in self._final:
                raise UsageError("already registered", argument="request_id", value=request_id)
            self._requests[request_id] = Outgoing(
                request_id, table, num_tokens, views, time.monotonic() + self.config.timeout_s
            )

    def layer_ready(self, request_id: str, layer: int) -> bool:
        """Layer ``layer`` of the request is on the host: push it to every reader. Idempotent.
        Returns False (and does nothing) when the request already finished or failed. Raises
        UsageError naming ``request_id`` (never registered) or ``layer`` (out of range)."""
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self.layout.num_layers:
            raise UsageError("must be in [0, num_layers)", argument="layer", value=layer)
        with self._lock:
            req = self._requests.get(request_id)
            if req is None:
                if request_id in self._final:
                    return False
                raise UsageError("not registered", argument="request_id", value=request_id)
            if req.state is not RequestState.PENDING:
                return False
            if layer in req.ready:
                return True
            req.ready.append(layer)
            waiters, req.waiters = req.waiters, []
        for wake in waiters:  # parked KV_NEXTs
            wake()
        self._sums.submit(req, layer)
        return True

    def abort(self, request_id: str, reason: str = "aborted", *, unread: bool = False) -> bool:
        """Stop serving the request; it is reported FAILED by the next :meth:`poll`. False (and
        nothing done) for an unknown or finished request, and with ``unread`` one a reader joined."""
        with self._lock:
            req = self._requests.get(request_id)
        return req is not None and self._fail(req, reason, unread)

    def settle(self, request_id: str) -> None:
        """Finish now what :meth:`layer_ready` left to the producer's thread for the request:
        the checksums a reader is answered with, of every ready layer (a no-op before any
        reader connected, or once the request finished). A prefill
        engine need not call it: its forward takes far longer than the sums, which run
        meanwhile. A benchmark does, so a read it times starts from an idle producer, as a
        decode engine's read does after the prefill answered. Raises UsageError naming
        ``request_id`` (never registered)."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is None and request_id not in self._final:
                raise UsageError("not registered", argument="request_id", value=request_id)
            if req is None or req.state is not RequestState.PENDING:
                return
            ready = list(req.ready)
        for layer in ready:
            self._sums.known(req, layer)

    def state(self, request_id: str) -> RequestState | None:
        """The request's state, or None when unknown (never registered, or reported and forgotten)."""
        with self._lock:
            req = self._requests.get(request_id)
            return req.state if req is not None else self._final.get(request_id)

    def poll(self) -> FinishedRequests:
        """Expire overdue requests (FAILED), then report every request that became final since
        the last poll, once: ``done_sending`` (every reader acknowledged) and ``failed_sending``."""
        now = time.monotonic()
        with self._lock:
            overdue = [r for r in self._requests.values() if r.state is RequestState.PENDING and now >= r.deadline]
        for req in overdue:
            self._fail(req, "timed out")
        with self._lock:
            self._progress.clear()
            items, self._unreported = self._unreported, []
        done = frozenset(i for i, s in items if s is RequestState.DONE)
        return FinishedRequests(done_sending=done, failed_sending=frozenset(i for i, s in items) - done)

    def wait_progress(self, timeout: float) -> bool:
        """Block until a request became final that :meth:`poll` has not reported yet (True at once
        if one did), or ``timeout`` s pass (False). Only :meth:`poll` enforces deadlines: call it next."""
        return self._progress.wait(timeout)

    def close(self) -> None:
        """Fail every pending request, stop serving, join the threads. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        with self._lock:
            pending = list(self._requests.values())
        for req in pending:
            self._fail(req, "producer closed")
        self._server.close()
        self._sums.close()

    def __enter__(self) -> KVProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise ClosedError("producer is closed", argument="self")

    # -- state transitions (always under the condition) ----------------------------------------
    def _finish(self, req: Outgoing, state: RequestState, reason: str = "") -> list[Session] | None:
        """Move a PENDING request to ``state``; returns its sessions, or None when already final."""
        if req.state is not RequestState.PENDING:
            return None
        req.state, req.reason = state, reason
        self._requests.pop(req.request_id, None)
        self._final[req.request_id] = state
        while len(self._final) > _FORGET_AFTER:
            self._final.popitem(last=False)
        socks, req.sessions = list(req.sessions), set()
        for wake in req.waiters:  # parked KV_NEXTs answer it ended (each just hands its session to the pool)
            wake()
        req.waiters = []
        return socks

    def _fail(self, req: Outgoing, reason: str, unread: bool = False) -> bool:
        """FAILED (False: it already was final, or ``unread`` and a reader joined it); its readers'
        sessions are closed *before* it becomes visible to poll, so a buffer reused after the
        report is never sent."""
        with self._lock:
            socks = None if unread and req.joined else self._finish(req, RequestState.FAILED, reason)
        if socks is None:
            return False
        for session in socks:
            session.close()
        with self._lock:
            self._unreported.append((req.request_id, RequestState.FAILED))
        self._progress.set()
        return True

    def _ack(self, req: Outgoing, dst_rank: int) -> bool:
        """Count reader ``dst_rank``; False when the request is no longer pending (not counted)."""
        with self._lock:
            if req.state is not RequestState.PENDING or time.monotonic() >= req.deadline:
                return False
            req.acked.add(dst_rank)
            if req.acked >= req.expected:
                self._finish(req, RequestState.DONE)
                self._unreported.append((req.request_id, RequestState.DONE))
                self._progress.set()
            return True

    # -- serving (a Service on the one TcpServer: handle runs on its worker pool) --------------
    def handle(self, session: Session, event: object) -> Iterable[object] | Park:
        """Answer one request of a reader's session (see :mod:`tiersync.disagg.ops`). A gathered
        pull is yielded, so the server writes it before this session's next pull reuses the
        staging buffer. A KV_NEXT whose layer is not ready parks the session (no worker waits)."""
        try:
            if isinstance(event, KvPull):
                return self._reads.pull(session, event, self._route_of)
            answer = self._answer(session, event)
        except Refused as exc:
            answer = ev.Error(cast(ev.Request, event).request_id, exc.code, str(exc)[:512])  # a parsed KV request
        return answer if isinstance(answer, Park) else [answer]

    def _answer(self, session: Session, event: object) -> object:
        if isinstance(event, KvOpen):
            return self._open(session, event)
        if isinstance(event, KvDrop):  # a decode scheduler: no reader will come, free the blocks now
            ok = self.abort(event.kv_request, f"dropped by {session.peer}: no decode rank will read it", unread=True)
            return ev.CommitReply(event.request_id, *_DROPPED[ok])
        route = self._route_of(session)
        if isinstance(event, KvNext):
            return self._next(route, event)
        if isinstance(event, KvPullLocal):
            return self._reads.pull_local(session, route, event)
        if isinstance(event, KvDone):
            return self._done(session, route, event)
        raise Refused(Code.UNSUPPORTED, f"{type(event).__name__} is not a prefill -> decode request")

    def opened(self, session: Session) -> None:
        self._sums.enable()  # from now on each ready layer is summed ahead of its pulls

    def closed(self, session: Session) -> None:
        """A reader's connection ended: a request it joined and did not finish fails."""
        with self._lock:
            route = self._routes.pop(session.session_id, None)
            if route is not None:
                route.req.sessions.discard(session)
        self._reads.forget(session)
        if route is not None and not route.counted:
            self._fail(route.req, f"reader {session.peer} disconnected before it was done")

    def _route_of(self, session: Session) -> Route:
        with self._lock:
            route = self._routes.get(session.session_id)
        if route is None:
            raise Refused(Code.BAD_REQUEST, "no request is open on this connection (KV_OPEN first)")
        if route.req.state is not RequestState.PENDING:
            raise Refused(Code.LEASE_EXPIRED, "request timed out, was aborted or failed")
        return route

    def _open(self, session: Session, event: KvOpen) -> KvOpened:
        """Check a KV_OPEN against the registration; join the reader. Raises Refused."""
        read = event.read
        with self._lock:
            if session.session_id in self._routes:
                raise Refused(Code.BAD_REQUEST, "a request is already open on this connection")
        if read.src_rank != self.rank:
            raise Refused(Code.BAD_REQUEST, f"wrong rank: this is rank {self.rank}, not {read.src_rank}")
        if read.src_layout != self.layout:  # its plan would put our bytes where our layout does not
            raise Refused(Code.BAD_REQUEST, "mismatch: the reader planned with another layout of this prefill engine")
        with self._lock:
            req = self._requests.get(read.request_id)
        if req is None:
            raise Refused(Code.NOT_FOUND, f"unknown request {read.request_id!r}: not registered or already final")
        blocks = _run_of(req.block_ids, read.src_block_ids, self.layout.blocks_needed(read.num_tokens))
        if blocks is None or blocks[0] * self.layout.block_size + read.num_tokens > req.num_tokens:
            raise Refused(Code.BAD_REQUEST, "mismatch: num_tokens or source block ids differ from the registration")
        _check_reader(self.layout, read)  # before any planning: the reader's layout comes off the wire
        try:  # this reader's route only: what it costs is bounded by the request, not by its layout
            ranks, ids = (self.rank, read.dst_rank), read.dst_block_ids
            spans, readers = self._planner.route(self.layout, read.dst_layout, blocks[1], ids, read.num_tokens, ranks)
        except UsageError as exc:
            raise Refused(Code.BAD_REQUEST, exc.message) from None
        route = Route(req, read.dst_rank, spans[:, 0].copy(), spans[:, 2].copy())
        with self._lock:
            self._join(req, read, readers or (0,), session)
            self._routes[session.session_id] = route
        return KvOpened(event.request_id, int(route.lengths.sum()), route_digest(spans))

    def _join(self, req: Outgoing, read: ReadRequest, expected: tuple[int, ...], session: Session) -> None:
        """Join the reader, all or nothing: a refused one changes nothing of ``req``."""
        if req.state is not RequestState.PENDING:
            raise Refused(Code.NOT_FOUND, "unknown request: already final")
        if req.dst_layout is not None and req.dst_layout != read.dst_layout:
            raise Refused(Code.BAD_REQUEST, "mismatch: another reader of this request uses a different layout")
        readers = req.expected if req.dst_layout is not None else frozenset(expected)
        if read.dst_rank not in readers or read.dst_rank in req.joined:
            raise Refused(
                Code.BAD_REQUEST, f"mismatch: destination rank {read.dst_rank} is not expected or already reading"
            )
        req.dst_layout, req.expected = read.dst_layout, readers
        req.joined.add(read.dst_rank)
        req.sessions.add(session)

    def _next(self, route: Route, event: KvNext) -> KvLayer | Park:
        """The ``n``-th ready layer; Park until then (asked again when a layer is ready, the
        request ends or its deadline passes)."""
        if event.n != len(route.told) or event.n >= self.layout.num_layers:
            raise Refused(Code.BAD_REQUEST, f"KV_NEXT {event.n} out of order (expected {len(route.told)})")
        req = route.req
        with self._lock:
            if req.waits_for(event.n) and time.monotonic() < req.deadline:
                return Park(lambda wake: self._watch(req, event.n, wake), req.deadline)
            if req.state is not RequestState.PENDING or len(req.ready) <= event.n:
                raise Refused(Code.LEASE_EXPIRED, "request timed out or was aborted")
            layer = req.ready[event.n]
        route.told.append(layer)
        return KvLayer(event.request_id, layer)

    def _watch(self, req: Outgoing, n: int, wake: Callable[[], object]) -> None:
        """``wake()`` once the ``n``-th layer is ready or the request ended (at once if it is)."""
        with self._lock:
            if req.waits_for(n):
                req.waiters.append(wake)
                return
        wake()

    def _done(self, session: Session, route: Route, event: KvDone) -> ev.CommitReply:
        with self._lock:
            self._routes.pop(session.session_id, None)
            route.req.sessions.discard(session)
        self._reads.forget(session, reuse=True)
        route.counted = self._ack(route.req, route.dst_rank)
        if route.counted:
            return ev.CommitReply(event.request_id, ev.CommitStatus.COMMITTED)
        return ev.CommitReply(event.request_id, ev.CommitStatus.FAILED, "request timed out, was aborted or failed")


MAX_READER_TP = 16  # a reader's TP may replicate each of this rank's heads at most this often ...
MIN_READER_TP_BOUND = 256  # ... and any TP up to this (MQA / MLA: one KV head on many ranks)


def _check_reader(src: PagedKVLayout, read: ReadRequest) -> None:
    """Refuse (BAD_REQUEST) a reader rank outside its layout, or a layout whose TP size would
    make planning cost more than any real reshard (a route per destination rank and head)."""
    dst = read.dst_layout
    if not 0 <= read.dst_rank < dst.tp_size:
        raise Refused(Code.BAD_REQUEST, f"destination rank {read.dst_rank} outside tp_size {dst.tp_size}")
    if dst.tp_size > max(MIN_READER_TP_BOUND, MAX_READER_TP * max(src.tp_size, src.num_kv_heads)):
        raise Refused(Code.BAD_REQUEST, f"destination tp_size {dst.tp_size} is beyond any reshard of this layout")


def _run_of(registered: tuple[int, ...], asked: Sequence[int], need: int) -> tuple[int, tuple[int, ...]] | None:
    """(first index, blocks) when the first ``need`` of ``asked`` are a run of ``registered``
    (a reader may take part of a request: a decode engine that has its first blocks in its own
    prefix cache, or computes the last token itself); None otherwise."""
    ids = tuple(asked[:need])
    if not ids or len(ids) < need or ids[0] not in registered:
        return None
    first = registered.index(ids[0])
    return (first, ids) if registered[first : first + need] == ids else None
