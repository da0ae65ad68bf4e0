"""A listener that serves span GETs out of local buffers and hands control connections on.

Each accepted connection sends one first message. ``DATA_HELLO``: a data connection; every
following ``GET {v, t, o, r, c, s}`` (version, tensor, and a :class:`StridedSpan` of that
tensor's local shard) is answered with ``DATA`` carrying the span's bytes in C order, or
``ERROR`` when the provider refuses (stale version, unknown tensor, out-of-range span).
Any other first message goes to ``on_control(sock, message)`` (the publisher's
registration); without one the connection is closed. One thread per connection.
"""
from __future__ import annotations

import logging
import socket
import threading
from typing import Callable

import numpy as np

from tiersync.errors import TierSyncError
from tiersync.net.errors import ProtocolError, ProtocolFault
from tiersync.weights.executor import span_view
from tiersync.weights.spans import StridedSpan
from tiersync.weights.wire import Deadline, Forever, Message, Op, payload_checksum, recv_message, send_message, tune

__all__ = ["SpanServer", "Provider"]

log = logging.getLogger(__name__)

Provider = Callable[[int, str, dict, Deadline], tuple[np.ndarray, Callable[[], None]]]
"""``(version, tensor, get_meta, deadline) -> (flat uint8 local shard, release)`` once that tensor of that
version is complete; ``release()`` is called when the answer is sent (the bytes must not change
before). Raises a TierSyncError to refuse."""

_MAX_SUMS = 1 << 16  # cached span checksums (one version's chunks)
_ROWS_SENT_AS_IOVEC = 256  # strided spans of at most this many rows of >= 64 KiB go out zero-copy


def parse_span(meta: dict) -> StridedSpan:
    """The span of a GET; ProtocolError (MALFORMED) when ill-formed."""
    try:
        span = StridedSpan(int(meta["o"]), int(meta["r"]), tuple(int(c) for c in meta["c"]),
                           tuple(int(s) for s in meta["s"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"bad GET: {exc}", fault=ProtocolFault.MALFORMED) from exc
    if span.offset < 0 or span.row_bytes <= 0 or len(span.counts) != len(span.strides) or \
            any(c <= 0 for c in span.counts) or any(s < 0 for s in span.strides):
        raise ProtocolError("bad GET span", fault=ProtocolFault.MALFORMED)
    return span


def span_payload(shard: np.ndarray, span: StridedSpan) -> list[memoryview]:
    """Byte views of ``span`` in ``shard`` (flat uint8), in C order; a gathered copy when the
    span has many small rows. ProtocolError when it reaches past the shard."""
    if span.extent > shard.size:
        raise ProtocolError("span reaches past the shard", fault=ProtocolFault.OVERSIZE,
                            extent=span.extent, nbytes=shard.size)
    if span.is_contiguous:
        return [memoryview(shard[span.offset: span.offset + span.row_bytes])]
    if span.row_count <= _ROWS_SENT_AS_IOVEC and span.row_bytes >= 64 << 10:
        return [memoryview(shard[o: o + n]) for o, n in span.rows()]
    return [memoryview(np.ascontiguousarray(span_view(shard, span)).reshape(-1))]


class SpanServer:
    """Listens on ``listen`` and serves ``provider``; ``address`` is the bound "host:port"."""

    def __init__(self, listen: str, provider: Provider, *, io_timeout_s: float, max_meta: int, checksum: bool,
                 on_control: Callable[[socket.socket, Message], None] | None = None, name: str = "weights") -> None:
        host, _, port = listen.rpartition(":")
        self._sock = socket.create_server((host.strip("[]"), int(port)), backlog=128)
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._provider, self._on_control = provider, on_control
        self._timeout, self._max_meta, self._checksum = io_timeout_s, max_meta, checksum
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._sums: dict[tuple, int] = {}  # (version, tensor, span) -> payload checksum, one version
        self._sums_version = -1
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name=f"{name}-accept", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, addr = self._sock.accept()
            except OSError:
                return
            tune(sock)
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._conns.add(sock)
            threading.Thread(target=self._serve, args=(sock, f"{addr[0]}:{addr[1]}"), daemon=True,
                             name="weights-conn").start()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        try:
            first = recv_message(sock, Deadline(self._timeout, peer), self._max_meta)
            if first.op is Op.DATA_HELLO:
                self._data_loop(sock, peer)
            elif self._on_control is not None:
                with self._lock:
                    self._conns.discard(sock)  # the control owner closes it from now on
                self._on_control(sock, first)
                return
        except TierSyncError as exc:
            log.debug("weights connection from %s ended: %s", peer, exc)
        except OSError:
            pass
        with self._lock:
            self._conns.discard(sock)
        sock.close()

    def _data_loop(self, sock: socket.socket, peer: str) -> None:
        while not self._closed:
            sock.settimeout(None)
            msg = recv_message(sock, Forever(peer), self._max_meta)  # an idle data connection may wait
            if msg.op is not Op.GET or msg.payload_len:
                raise ProtocolError("expected GET", fault=ProtocolFault.UNEXPECTED, peer=peer)
            deadline = Deadline(self._timeout, peer)
            span = parse_span(msg.meta)
            try:
                shard, release = self._provider(int(msg.meta["v"]), str(msg.meta["t"]), msg.meta, deadline)
            except (TierSyncError, KeyError, ValueError) as exc:
                send_message(sock, Op.ERROR, {"message": str(exc)}, deadline)
                continue
            try:
                try:
                    payload = span_payload(shard, span)
                except ProtocolError as exc:
                    send_message(sock, Op.ERROR, {"message": str(exc)}, deadline)
                    continue
                send_message(sock, Op.DATA, {}, deadline, payload, checksum=self._checksum,
                             known_ck=self._payload_sum(msg.meta, span, payload) if self._checksum else None)
            finally:
                release()

    def _payload_sum(self, meta: dict, span: StridedSpan, payload: list[memoryview]) -> int:
        """The payload checksum of ``span`` of tensor ``meta["t"]`` of version ``meta["v"]``, computed
        once for every receiver that GETs it (replicated samplers ask for the same spans). Sound
        because a version's bytes never change while the provider serves it, and versions only
        grow: the cache holds the newest version seen and is dropped when a newer one is asked."""
        key = (int(meta["v"]), str(meta["t"]), span)
        with self._lock:
            known = self._sums.get(key)
        if known is not None:
            return known
        value = payload_checksum(payload)
        with self._lock:
            if key[0] > self._sums_version or len(self._sums) >= _MAX_SUMS:
                self._sums.clear()
                self._sums_version = max(key[0], self._sums_version)
            if key[0] == self._sums_version:
                self._sums[key] = value
        return value

    def close(self) -> None:
        """Stop accepting and close every data connection; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns, self._conns = list(self._conns), set()
        for s in [self._sock, *conns]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
