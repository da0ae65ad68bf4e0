"""How a sampler moves its part of a plan: jobs, the shared-memory copy and TCP GETs.

:func:`build_jobs` turns the transfers a destination rank receives into :class:`Job` s,
each with its sources in order of preference: a chunk whose pushing trainer shard is
reachable through shared memory is copied out of that shard's segment (relays are not
needed then: every same-host reader reads the one copy); otherwise a PUSH is a GET from the
trainer shard and a RELAY a GET from the relaying sampler, falling back to the trainer
shard when the relay fails. Jobs are ordered by (stage, tensor write order) so a chunk is
consumed in the order it is produced and no relay waits on a later stage.
:class:`TcpPool` keeps up to ``streams`` data connections per address.
"""
from __future__ import annotations

import queue
import socket
import threading
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from tiersync.errors import RemoteError, TierSyncError
from tiersync.weights.config import TransportKind
from tiersync.weights.executor import span_view
from tiersync.weights.plan import TransferKind, TransferPlan
from tiersync.weights.segment import SegmentReader
from tiersync.weights.spans import StridedSpan
from tiersync.weights.wire import Deadline, Op, connect, recv_message, recv_payload, send_message

__all__ = ["Job", "Source", "TcpPool", "build_jobs", "shm_copy"]


@dataclass(frozen=True, slots=True)
class Source:
    """Where one chunk can be read: ``via`` SHM (``rank`` = trainer shard) or TCP (``address``)."""

    via: TransportKind
    span: StridedSpan
    rank: int = -1
    address: str = ""


@dataclass(frozen=True, slots=True)
class Job:
    """One chunk to land at ``dst_span`` of tensor ``tensor`` (write position ``index``)."""

    tensor: str
    index: int
    key: tuple[int, ...]  # the chunk's global box start: what a relay GET names
    stage: int
    dst_span: StridedSpan
    sources: tuple[Source, ...]

    @property
    def nbytes(self) -> int:
        return self.dst_span.nbytes


def build_jobs(plan: TransferPlan, rank: int, order: Mapping[str, int], transports: Mapping[int, TransportKind],
               publishers: Mapping[int, str], peers: Mapping[int, str]) -> list[Job]:
    """The jobs of destination ``rank``. ``transports``/``publishers``: per trainer shard, how it is
    reached and its address; ``peers``: relay addresses of the other samplers."""
    roots = {}
    for t in plan.transfers:
        if t.kind is TransferKind.PUSH:
            roots.setdefault((t.tensor, t.global_box), t)
    jobs = []
    for t in plan.for_destination(rank):
        root = roots[(t.tensor, t.global_box)]
        src = root.src_rank
        if transports[src] is TransportKind.SHM:
            sources: tuple[Source, ...] = (Source(TransportKind.SHM, root.src_span, rank=src),)
        else:
            direct = Source(TransportKind.TCP, root.src_span, address=publishers[src])
            sources = (direct,)
            if t.kind is TransferKind.RELAY and t.src_rank in peers:
                sources = (Source(TransportKind.TCP, t.src_span, address=peers[t.src_rank]), direct)
        jobs.append(Job(t.tensor, order[t.tensor], t.global_box.start, t.stage if len(sources) > 1 else 0,
                        t.dst_span, sources))
    jobs.sort(key=lambda j: (j.stage, j.index, j.key))
    return jobs


def shm_copy(reader: SegmentReader, offset: int, nbytes: int, src_span: StridedSpan, dst: np.ndarray,
             dst_span: StridedSpan) -> None:
    """Copy ``src_span`` of the shard at ``offset`` (``nbytes``) in the segment to ``dst_span`` of
    ``dst``: one strided numpy copy (GIL released), no per-element Python."""
    src = span_view(reader.region(offset, nbytes), src_span)
    out = span_view(dst, dst_span)
    np.copyto(out, src.reshape(out.shape))


class TcpPool:
    """Data connections per address, at most ``streams`` open; thread-safe."""

    def __init__(self, streams: int, connect_timeout_s: float, io_timeout_s: float, max_meta: int) -> None:
        self._streams, self._connect_s, self._io_s, self._max_meta = streams, connect_timeout_s, io_timeout_s, max_meta
        self._idle: dict[str, queue.SimpleQueue] = {}
        self._count: dict[str, int] = {}
        self._all: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False

    def _take(self, address: str, deadline: Deadline) -> socket.socket:
        with self._lock:
            if self._closed:
                raise RemoteError("pool closed", peer=address)
            idle = self._idle.setdefault(address, queue.SimpleQueue())
            opening = self._count.get(address, 0) < self._streams and idle.empty()
            if opening:
                self._count[address] = self._count.get(address, 0) + 1
        if not opening:
            try:
                return idle.get(timeout=deadline.remaining())
            except queue.Empty:
                raise RemoteError("no data connection became free", peer=address) from None
        try:
            sock = connect(address, min(self._connect_s, deadline.remaining()))
            send_message(sock, Op.DATA_HELLO, {}, deadline)
        except BaseException:
            with self._lock:
                self._count[address] -= 1
            raise
        with self._lock:
            self._all.add(sock)
        return sock

    def _give(self, address: str, sock: socket.socket, ok: bool) -> None:
        if ok:
            self._idle[address].put(sock)
            return
        with self._lock:
            self._count[address] -= 1
            self._all.discard(sock)
        sock.close()

    def get(self, address: str, version: int, job: Job, src: Source, dst: np.ndarray, verify: bool) -> None:
        """GET ``src.span`` of ``job.tensor`` at ``address`` into ``job.dst_span`` of ``dst``.

        Raises RemoteError (refused, closed, timed out) or ProtocolError (bad bytes).
        """
        deadline = Deadline(self._io_s, address)
        sock = self._take(address, deadline)
        ok = False
        try:
            span = src.span
            meta = {"v": version, "t": job.tensor, "b": list(job.key), "o": span.offset, "r": span.row_bytes,
                    "c": list(span.counts), "s": list(span.strides)}
            send_message(sock, Op.GET, meta, deadline)
            msg = recv_message(sock, deadline, self._max_meta)
            if msg.op is Op.ERROR:
                ok = msg.payload_len == 0
                raise RemoteError(f"GET refused: {msg.meta.get('message')}", peer=address)
            if msg.op is not Op.DATA:
                raise RemoteError(f"unexpected answer {msg.op.name}", peer=address)
            if job.dst_span.is_contiguous:
                into = dst.reshape(-1).view(np.uint8)[job.dst_span.offset: job.dst_span.offset + job.nbytes]
                recv_payload(sock, msg, memoryview(into), deadline, verify=verify)
            else:
                tmp = np.empty(job.nbytes, np.uint8)
                recv_payload(sock, msg, memoryview(tmp), deadline, verify=verify)
                out = span_view(dst, job.dst_span)
                np.copyto(out, tmp.reshape(out.shape))
            ok = True
        finally:
            self._give(address, sock, ok)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks, self._all = list(self._all), set()
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


def first_error(errors: list[BaseException]) -> BaseException | None:
    """The most telling of several errors (a TierSyncError over others)."""
    for e in errors:
        if isinstance(e, TierSyncError):
            return e
    return errors[0] if errors else None
