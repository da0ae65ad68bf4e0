"""How a sampler moves its part of a plan: jobs, the shared-memory copy and TCP GETs.

:func:`build_jobs` turns the transfers a destination rank receives into :class:`Job` s,
each with its sources in order of preference: a chunk whose pushing trainer shard is
reachable through shared memory is copied out of that shard's segment (relays are not
needed then: every same-host reader reads the one copy); otherwise a PUSH is a GET from the
trainer shard and a RELAY a GET from the relaying sampler, falling back to the trainer
shard when the relay fails. Jobs are ordered by (stage, tensor write order) so a chunk is
consumed in the order it is produced and no relay waits on a later stage.
:class:`TcpPool` keeps up to ``streams`` authenticated data channels per address
(:class:`~tiersync.net.tcp.TcpChannel` s in the one :class:`~tiersync.net.pool.ChannelPool`);
a GET's DATA lands straight in the sampler's buffer (the rows of a strided destination span
too, when they are few), checksum verified. Chunks
with one source go out pipelined, a window of GETs in flight per channel (:meth:`TcpPool.get_many`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np

from tiersync.errors import RemoteError, TierSyncError, UsageError
from tiersync.net.config import TcpConfig
from tiersync.net.errors import RequestError
from tiersync.net.pool import ChannelPool
from tiersync.net.tcp import TcpChannel, TcpTransport
from tiersync.weights.config import TransportKind
from tiersync.weights.executor import span_view
from tiersync.weights.ops import WEIGHTS, Get, Sums, SumsReply
from tiersync.weights.segment import SegmentReader
from tiersync.weights.sharding import Box
from tiersync.weights.spans import StridedSpan
from tiersync.weights.transfer_plan import Transfer, TransferKind, TransferPlan

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["Job", "Source", "TcpPool", "build_jobs", "shm_copy"]

_IDLE_S = 3600.0  # an idle data channel is reconnected after this long
_ROWS_IN_PLACE = 256  # a strided destination of at most this many rows is received row by row


@dataclass(frozen=True, slots=True)
class Source:
    """Where one chunk can be read: ``via`` SHM (``rank`` = trainer shard) or TCP (``address``);
    ``incarnation``: the trainer shard's whose bytes it is (what its GETs name: a trainer shard
    refuses another one's; a relay keys its cached checksums by it)."""

    via: TransportKind
    span: StridedSpan
    rank: int = -1
    address: str = ""
    incarnation: int = 0


@dataclass(frozen=True, slots=True)
class Job:
    """One chunk to land at ``dst_span`` of tensor ``tensor`` (write position ``index``)."""

    tensor: str
    index: int
    key: tuple[int, ...]  # the chunk's global box start: what a relay GET names
    stage: int
    dst_span: StridedSpan
    sources: tuple[Source, ...]
    origin: int = 0  # the trainer shard that pushes the chunk (what a delta asks for its checksum)
    origin_span: StridedSpan | None = None  # the chunk in that shard's local buffer

    @property
    def nbytes(self) -> int:
        return self.dst_span.nbytes


def build_jobs(
    plan: TransferPlan,
    rank: int,
    order: Mapping[str, int],
    transports: Mapping[int, TransportKind],
    publishers: Mapping[int, str],
    peers: Mapping[int, str],
    incarnations: Mapping[int, int],
) -> list[Job]:
    """The jobs of destination ``rank``. ``transports``/``publishers``/``incarnations``: per
    trainer shard, how it is reached, its address and the incarnation its manifest names;
    ``peers``: relay addresses of the other samplers."""
    roots: dict[tuple[str, Box], Transfer] = {}
    for t in plan.transfers:
        if t.kind is TransferKind.PUSH:
            roots.setdefault((t.tensor, t.global_box), t)
    jobs = []
    for t in plan.for_destination(rank):
        root = roots[(t.tensor, t.global_box)]
        src = root.src_rank
        if transports[src] is TransportKind.SHM:
            sources: tuple[Source, ...] = (Source(TransportKind.SHM, root.src_span, src, "", incarnations[src]),)
        else:
            direct = Source(TransportKind.TCP, root.src_span, address=publishers[src], incarnation=incarnations[src])
            sources = (direct,)
            if t.kind is TransferKind.RELAY and t.src_rank in peers:
                relay = Source(TransportKind.TCP, t.src_span, address=peers[t.src_rank], incarnation=incarnations[src])
                sources = (relay, direct)
        jobs.append(
            Job(
                t.tensor,
                order[t.tensor],
                t.global_box.start,
                t.stage if len(sources) > 1 else 0,
                t.dst_span,
                sources,
                src,
                root.src_span,
            )
        )
    jobs.sort(key=lambda j: (j.stage, j.index, j.key))
    return jobs


def shm_copy(
    reader: SegmentReader, offset: int, nbytes: int, src_span: StridedSpan, dst: np.ndarray, dst_span: StridedSpan
) -> None:
    """Copy ``src_span`` of the shard at ``offset`` (``nbytes``) in the segment to ``dst_span`` of
    ``dst``: one strided numpy copy (GIL released), no per-element Python."""
    src = span_view(reader.region(offset, nbytes), src_span)
    out = span_view(dst, dst_span)
    np.copyto(out, src.reshape(out.shape))


class TcpPool:
    """Data channels per address, at most ``streams`` open (a
    :class:`~tiersync.net.pool.ChannelPool` with that cap); thread-safe."""

    def __init__(self, streams: int, config: TcpConfig, io_timeout_s: float) -> None:
        self._io_s = io_timeout_s
        self._pool = ChannelPool(  # kept between syncs (minutes apart in RL): a dead peer's go by keepalive
            TcpTransport(config, WEIGHTS), max_idle_per_peer=streams, max_idle_s=_IDLE_S, max_open_per_peer=streams
        )

    def get(
        self, address: str, version: int, job: Job, src: Source, dst: np.ndarray, timeout: float | None = None
    ) -> None:
        """GET ``src.span`` of ``job.tensor`` at ``address`` into ``job.dst_span`` of ``dst``
        (:meth:`get_many` of that one chunk from ``src``, within ``timeout``, or ``io_timeout_s``
        for None: waiting for a free channel may take that long, each step of the GET at most
        ``io_timeout_s``).

        Raises RemoteError (refused, timed out; AuthError: the token or TLS check failed),
        ProtocolError (bad bytes) or ClosedError (the pool was closed).
        """
        one = dataclasses.replace(job, sources=(src,))
        limit = self._io_s if timeout is None else timeout
        self.get_many(address, version, [one], {job.tensor: dst}, 1, lambda _job: None, limit)

    def get_many(
        self,
        address: str,
        version: int,
        jobs: Iterable[Job],
        bufs: Mapping[str, np.ndarray],
        window: int,
        landed: Callable[[Job], None],
        timeout: float,
    ) -> None:
        """GET ``jobs`` (each from its one source, at ``address``; taken from the iterable as
        requests go out) on one channel, ``window`` in flight: the sender answers the next while
        one lands, and consecutive answers land in one native call. ``landed(job)`` runs once a
        job's bytes are verified and in place, in order. ``timeout`` covers the batch, the wait
        for a free channel (the streams of other batches hold) included; each step of it (a
        connect, a send, the next answers) also has ``io_timeout_s``, so a sender that stops
        answering with its socket open fails the batch after that long.
        Raises like :meth:`get` (an exception from ``landed`` too); the jobs
        not reported landed may hold some of their bytes or none."""
        end = time.monotonic() + timeout
        with self._pool.acquire(address, timeout, connect_timeout=self._io_s) as pooled:
            channel = cast(TcpChannel, pooled)  # the pool connects with a TcpTransport
            of: dict[int, tuple[Job, np.ndarray | None, object]] = {}

            def requests() -> Iterator[tuple[Get, object]]:  # staging buffers made as requests go out
                for job in jobs:
                    into, strided = _landing(bufs[job.tensor], job.dst_span)
                    src = job.sources[0]
                    get = Get(channel.new_request_id(), version, job.tensor, job.key, src.span, src.incarnation)
                    of[get.request_id] = (job, strided, into)
                    yield get, into

            def done(request_id: int, _answer: object) -> None:
                job, strided, into = of.pop(request_id)
                if strided is not None:
                    np.copyto(strided, np.frombuffer(cast(memoryview, into), np.uint8).reshape(strided.shape))
                landed(job)

            try:
                left = max(0.001, end - time.monotonic())
                channel.pipeline(requests(), window=window, timeout=left, idle=self._io_s, landed=done)
            except RequestError as exc:
                raise RemoteError(f"GET refused: {exc.message}", peer=address) from None

    def sums(
        self, address: str, version: int, incarnation: int, tensor: str, spans: tuple[StridedSpan, ...]
    ) -> SumsReply:
        """W_SUMS to the trainer shard at ``address`` (of ``incarnation``): the checksums of
        ``spans`` of ``tensor``. Raises RemoteError (refused, e.g. the shard moved on or
        restarted) or ProtocolError."""
        end = time.monotonic() + self._io_s
        try:
            with self._pool.acquire(address, self._io_s) as channel:
                reply = channel.request(
                    Sums(channel.new_request_id(), version, tensor, spans, incarnation),
                    timeout=max(0.001, end - time.monotonic()),
                )
        except RequestError as exc:
            raise RemoteError(f"W_SUMS refused: {exc.message}", peer=address) from None
        if not isinstance(reply, SumsReply) or len(reply.sums) != len(spans):
            raise RemoteError("W_SUMS answered with the wrong number of checksums", peer=address)
        return reply

    def close(self) -> None:
        """Close every channel, a GET under way too (it fails at once)."""
        self._pool.close(abort=True)


def _landing(dst: np.ndarray, span: StridedSpan) -> tuple[object, np.ndarray | None]:
    """Where a GET of ``span`` of ``dst`` lands: its bytes (contiguous), its rows (a few), or a
    staging buffer to copy into the returned strided view (many small rows)."""
    flat = dst.reshape(-1).view(np.uint8)
    # numpy arrays export the buffer protocol; its stubs do not say so (hence the casts)
    if span.is_contiguous:
        return memoryview(cast("Buffer", flat[span.offset : span.offset + span.nbytes])), None
    if span.row_count <= _ROWS_IN_PLACE:
        return [memoryview(cast("Buffer", flat[o : o + n])) for o, n in span.rows()], None
    return memoryview(cast("Buffer", np.empty(span.nbytes, np.uint8))), span_view(dst, span)


def first_error(errors: Sequence[BaseException]) -> BaseException:
    """The most telling of several errors (a TierSyncError over others); ``errors`` is not empty."""
    for e in errors:
        if isinstance(e, TierSyncError):
            return e
    if not errors:
        raise UsageError("no error to choose from", argument="errors")
    return errors[0]
