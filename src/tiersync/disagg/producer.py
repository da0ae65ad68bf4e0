"""Prefill side: serve a request's KV to the decode ranks, layer by layer, over TCP.

One :class:`KVProducer` per prefill rank. Typical use from an engine connector::

    producer = KVProducer(layout, rank=tp_rank, config=DisaggConfig(token=secret))
    producer.register(req_id, block_ids, num_tokens, host_layers)   # before the forward pass
    ...  # per layer, after its D2H copy into host_layers[l] completed:
    producer.layer_ready(req_id, l)
    ...  # every engine step:
    status = producer.poll()   # done_sending / failed_sending: free the request's blocks

Decode ranks connect, prove the token, send READ (their layout and block ids); the producer
plans (:mod:`tiersync.disagg.reshard`), then pushes each layer of the route as soon as it is
ready and waits for the reader's DONE. The request is DONE when every destination rank that
reads from this rank acknowledged; it is FAILED when ``config.timeout_s`` after
:meth:`register` passes first (an expired send is never reported as done), when a reader
fails or disconnects, or on :meth:`abort`. Unknown requests are refused (ERROR
``unknown_request``): register before the decode side can learn of the request.
"""
from __future__ import annotations

import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from tiersync.disagg.config import DisaggConfig, RequestState, TransferStatus, check_side
from tiersync.disagg.conn import FrameSocket, server_handshake
from tiersync.disagg.geometry import PagedKVLayout
from tiersync.disagg.messages import LayerChunk, ReadRequest, check_request_id, parse_read
from tiersync.disagg.reshard import ReshardPlanner, block_table, default_planner
from tiersync.disagg.spanio import byte_view, gather
from tiersync.disagg.wire import Kind
from tiersync.errors import ClosedError, UsageError, check_positive_int
from tiersync.net.errors import AuthError, PeerClosedError, ProtocolError, RequestError

__all__ = ["KVProducer"]

_FORGET_AFTER = 4096  # final request ids remembered so a late layer_ready is a no-op
_ZERO_COPY_SPANS = 256  # routes with at most this many spans are sent without a gather copy


class _Refused(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(eq=False)
class _Outgoing:
    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    views: list[np.ndarray]
    deadline: float
    ready: list[int] = field(default_factory=list)  # layers in the order they became ready
    state: RequestState = RequestState.PENDING
    reason: str = ""
    dst_layout: PagedKVLayout | None = None
    expected: frozenset[int] = frozenset()
    joined: set[int] = field(default_factory=set)
    acked: set[int] = field(default_factory=set)
    sockets: set[FrameSocket] = field(default_factory=set)


class KVProducer:
    """Serves registered requests on ``host:port`` (``port=0``: any free port, see
    :attr:`address`). ``layout`` is this TP group's geometry; ``rank`` this process's rank in
    it. Thread-safe; close with :meth:`close` (or use as a context manager)."""

    def __init__(self, layout: PagedKVLayout, rank: int, config: DisaggConfig | None = None, *,
                 host: str = "127.0.0.1", port: int = 0, planner: ReshardPlanner | None = None) -> None:
        self.config = check_side(layout, rank, config)
        self.layout, self.rank = layout, rank
        self._planner = planner or default_planner()
        self._cond = threading.Condition()
        self._requests: dict[str, _Outgoing] = {}
        self._final: OrderedDict[str, RequestState] = OrderedDict()
        self._unreported: list[tuple[str, RequestState]] = []
        self._progress = threading.Event()  # set when a request became final since the last poll
        self._closed = threading.Event()
        self._threads: set[threading.Thread] = set()
        self._listener = socket.create_server((host, port), backlog=self.config.backlog)
        self._listener.settimeout(0.2)
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._accept_thread = threading.Thread(target=self._accept_loop, name="tiersync-kv-accept", daemon=True)
        self._accept_thread.start()

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
        with self._cond:
            if request_id in self._requests or request_id in self._final:
                raise UsageError("already registered", argument="request_id", value=request_id)
            self._requests[request_id] = _Outgoing(request_id, table, num_tokens, views,
                                                   time.monotonic() + self.config.timeout_s)

    def layer_ready(self, request_id: str, layer: int) -> bool:
        """Layer ``layer`` of the request is on the host: push it to every reader. Idempotent.
        Returns False (and does nothing) when the request already finished or failed. Raises
        UsageError naming ``request_id`` (never registered) or ``layer`` (out of range)."""
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self.layout.num_layers:
            raise UsageError("must be in [0, num_layers)", argument="layer", value=layer)
        with self._cond:
            req = self._requests.get(request_id)
            if req is None:
                if request_id in self._final:
                    return False
                raise UsageError("not registered", argument="request_id", value=request_id)
            if req.state is not RequestState.PENDING:
                return False
            if layer not in req.ready:
                req.ready.append(layer)
                self._cond.notify_all()
            return True

    def abort(self, request_id: str) -> None:
        """Stop serving the request; it is reported FAILED by the next :meth:`poll`. No-op for an
        unknown or finished request."""
        with self._cond:
            req = self._requests.get(request_id)
        if req is not None:
            self._fail(req, "aborted")

    def state(self, request_id: str) -> RequestState | None:
        """The request's state, or None when unknown (never registered, or reported and forgotten)."""
        with self._cond:
            req = self._requests.get(request_id)
            return req.state if req is not None else self._final.get(request_id)

    def poll(self) -> TransferStatus:
        """Expire overdue requests (FAILED), then report every request that became final since
        the last poll, once: ``done_sending`` (every reader acknowledged) and ``failed_sending``."""
        now = time.monotonic()
        with self._cond:
            overdue = [r for r in self._requests.values() if r.state is RequestState.PENDING and now >= r.deadline]
        for req in overdue:
            self._fail(req, "timed out")
        with self._cond:
            self._progress.clear()
            items, self._unreported = self._unreported, []
        done = frozenset(i for i, s in items if s is RequestState.DONE)
        return TransferStatus(done_sending=done, failed_sending=frozenset(i for i, s in items) - done)

    def wait_progress(self, timeout: float) -> bool:
        """Block (GIL released) until a request became final that :meth:`poll` has not yet
        reported (True at once if one already did), or ``timeout`` seconds pass (False).
        Deadlines are only enforced by :meth:`poll`; call it after waiting."""
        return self._progress.wait(timeout)

    def close(self) -> None:
        """Fail every pending request, stop serving, join the threads. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        with self._cond:
            pending = list(self._requests.values())
        for req in pending:
            self._fail(req, "producer closed")
        self._accept_thread.join(timeout=5)
        self._listener.close()
        for t in list(self._threads):
            t.join(timeout=5)

    def __enter__(self) -> "KVProducer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise ClosedError("producer is closed", argument="self")

    # -- state transitions (always under the condition) ----------------------------------------
    def _finish(self, req: _Outgoing, state: RequestState, reason: str = "") -> list[FrameSocket] | None:
        """Move a PENDING request to ``state``; returns its sockets, or None when already final."""
        if req.state is not RequestState.PENDING:
            return None
        req.state, req.reason = state, reason
        self._requests.pop(req.request_id, None)
        self._final[req.request_id] = state
        while len(self._final) > _FORGET_AFTER:
            self._final.popitem(last=False)
        socks, req.sockets = list(req.sockets), set()
        self._cond.notify_all()
        return socks

    def _fail(self, req: _Outgoing, reason: str) -> None:
        """FAILED; its sockets are closed *before* it becomes visible to poll, so a buffer the
        caller reuses after the report is never sent."""
        with self._cond:
            socks = self._finish(req, RequestState.FAILED, reason)
        if socks is None:
            return
        for fs in socks:
            fs.shutdown()
        with self._cond:
            self._unreported.append((req.request_id, RequestState.FAILED))
        self._progress.set()

    def _ack(self, req: _Outgoing, dst_rank: int) -> None:
        with self._cond:
            if req.state is not RequestState.PENDING or time.monotonic() >= req.deadline:
                return
            req.acked.add(dst_rank)
            if req.acked >= req.expected:
                self._finish(req, RequestState.DONE)
                self._unreported.append((req.request_id, RequestState.DONE))
                self._progress.set()

    # -- serving ---------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, peer = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(sock, f"{peer[0]}:{peer[1]}"), daemon=True,
                                 name="tiersync-kv-send")
            self._threads.add(t)
            t.start()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.config.sndbuf)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        fs = FrameSocket(sock, peer, self.config.limits)
        joined: list[_Outgoing] = []
        try:
            self._serve_read(fs, joined)
        except _Refused as exc:
            self._end(fs, joined, exc.code, str(exc))
        except (RequestError, PeerClosedError, AuthError) as exc:  # the peer knows already
            self._end(fs, joined, None, f"reader {peer} failed: {exc}")
        except ProtocolError as exc:
            self._end(fs, joined, "protocol", f"reader {peer} sent a bad frame: {exc}")
        except Exception as exc:  # noqa: BLE001 - timeouts, socket errors, bugs: fail, never crash
            self._end(fs, joined, "failed", f"serving reader {peer} failed: {exc!r}")
        finally:
            fs.close()
            self._threads.discard(threading.current_thread())

    def _serve_read(self, fs: FrameSocket, joined: list[_Outgoing]) -> None:
        """Handshake, READ, push every layer, wait for DONE. ``joined`` gets the request once the
        reader joined it (so a later failure fails the request)."""
        hs_deadline = time.monotonic() + self.config.connect_timeout_s
        server_handshake(fs, self.config.token, hs_deadline)
        read = parse_read(fs.expect(Kind.READ, hs_deadline).meta)
        req, spans = self._admit(read, fs)
        joined.append(req)
        self._push(req, spans, fs)
        fs.expect(Kind.DONE, req.deadline)
        self._ack(req, read.dst_rank)

    def _end(self, fs: FrameSocket, joined: list[_Outgoing], code: str | None, reason: str) -> None:
        if code is not None:
            fs.send_error(code, reason, time.monotonic() + 1.0)
        for req in joined:
            self._fail(req, reason)

    def _admit(self, read: ReadRequest, fs: FrameSocket) -> tuple[_Outgoing, np.ndarray]:
        """Check a READ against the registration; join the reader. Raises _Refused."""
        if read.src_rank != self.rank:
            raise _Refused("wrong_rank", f"this is rank {self.rank}, not {read.src_rank}")
        with self._cond:
            req = self._requests.get(read.request_id)
        if req is None:
            raise _Refused("unknown_request", f"request {read.request_id!r} is not registered or already final")
        if read.num_tokens != req.num_tokens or read.src_block_ids[: len(req.block_ids)] != req.block_ids:
            raise _Refused("mismatch", "num_tokens or source block ids differ from the registration")
        try:
            plan = self._planner.plan(self.layout, read.dst_layout, req.block_ids, read.dst_block_ids, req.num_tokens)
        except UsageError as exc:
            raise _Refused("bad_request", exc.message) from None
        with self._cond:
            self._join(req, read, plan.readers_of(self.rank) or (0,), fs)
        return req, plan.route_spans(self.rank, read.dst_rank)

    def _join(self, req: _Outgoing, read: ReadRequest, expected: tuple[int, ...], fs: FrameSocket) -> None:
        if req.state is not RequestState.PENDING:
            raise _Refused("unknown_request", "request already final")
        if req.dst_layout is None:
            req.dst_layout, req.expected = read.dst_layout, frozenset(expected)
        elif req.dst_layout != read.dst_layout:
            raise _Refused("mismatch", "another reader of this request uses a different layout")
        if read.dst_rank not in req.expected or read.dst_rank in req.joined:
            raise _Refused("mismatch", f"destination rank {read.dst_rank} is not expected or already reading")
        req.joined.add(read.dst_rank)
        req.sockets.add(fs)

    def _next_layer(self, req: _Outgoing, sent: int) -> int | None:
        """Wait for the ``sent``-th ready layer; None when the request became final."""
        with self._cond:
            while req.state is RequestState.PENDING and len(req.ready) <= sent:
                left = req.deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(min(left, 1.0))
            return req.ready[sent] if req.state is RequestState.PENDING else None

    def _push(self, req: _Outgoing, spans: np.ndarray, fs: FrameSocket) -> None:
        """Send each ready layer's route bytes in LAYER chunks. Few large spans go out as views of
        the host buffer (no copy); many small ones are gathered into a staging buffer first."""
        if spans.shape[0] == 0:
            return
        total = int(spans[:, 2].sum())
        staging = None if spans.shape[0] <= _ZERO_COPY_SPANS else np.empty(total, dtype=np.uint8)
        for sent in range(self.layout.num_layers):
            layer = self._next_layer(req, sent)
            if layer is None:
                raise _Refused("expired", "request timed out or was aborted")
            if staging is None:
                view = req.views[layer]
                pieces = [view[o:o + n] for o, n in zip(spans[:, 0].tolist(), spans[:, 2].tolist())]
            else:
                pieces = [gather(req.views[layer], spans[:, 0], spans[:, 2], out=staging)]
            for off, chunk in _chunks(pieces, self.config.chunk_bytes):
                fs.send(Kind.LAYER, LayerChunk(layer, off, total).to_meta(), req.deadline, chunk)


def _chunks(pieces: list[np.ndarray], limit: int):
    """Split consecutive byte arrays into ``(offset, [arrays])`` groups of at most ``limit`` bytes."""
    group: list[np.ndarray] = []
    size = start = 0
    for piece in pieces:
        while piece.size:
            take = piece[: limit - size]
            group.append(take)
            size += take.size
            piece = piece[take.size:]
            if size == limit:
                yield start, group
                start, group, size = start + size, [], 0
    if group:
        yield start, group
