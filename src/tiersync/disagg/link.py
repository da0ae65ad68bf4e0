"""One decode rank reading one request from one prefill rank over one connection.

:func:`pull_route` speaks :mod:`tiersync.disagg.ops` on a
:class:`~tiersync.net.tcp.TcpChannel`: open, then for each layer as it becomes ready pull its
route bytes straight into the destination blocks — over TCP with ``config.window`` pulls of
at most ``config.chunk_bytes`` in flight (each DATA scattered in place into the blocks it
covers, checksum verified), or, when the producer is on this host and the route allows it, by
copying them out of the producer's memory into the blocks (``process_vm_readv``, every region
verified; route AUTO falls back to TCP when that is refused) — report each layer to
``landed``, and finish with KV_DONE, which must be COMMITTED.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np

from tiersync.disagg.config import DisaggConfig
from tiersync.disagg.layer_reads import ZERO_COPY_AVG
from tiersync.disagg.messages import ReadRequest
from tiersync.disagg.ops import KvDone, KvLayer, KvNext, KvOpen, KvOpened, KvPull, KvPullLocal
from tiersync.disagg.reshard import route_digest
from tiersync.disagg.spanio import route_slice, scatter
from tiersync.errors import RemoteError
from tiersync.net import events as ev
from tiersync.net.errors import NetTimeoutError, ProtocolError, ProtocolFault, RequestError
from tiersync.net.local import LocalReadError, refusal
from tiersync.net.pull_plan import Later
from tiersync.net.tcp import TcpChannel

if TYPE_CHECKING:
    from typing_extensions import Buffer as _Buffer

__all__ = ["pull_route"]

Buffer = Callable[[int], np.ndarray]
Landed = Callable[[int], None]
_LOCAL_WINDOW = 2  # same-host pulls out at once: the producer alternates two gather buffers
_LOCAL_PIECE_MAX = 32 << 20  # bytes per same-host pull at most (and within both ends' max_frame_size)


@dataclass(frozen=True, slots=True)
class _Route:
    """The route's spans: source offsets, destination offsets, lengths (one row per span)."""

    src: np.ndarray
    dst: np.ndarray
    lengths: np.ndarray
    digest: int  # of the rows, as KV_OPENED must carry it

    def dests(self, buf: np.ndarray, offset: int, size: int) -> list[memoryview]:
        """Views of ``buf`` (the destination layer) that receive route bytes ``[offset, offset+size)``."""
        offs, lens = route_slice(self.dst, self.lengths, offset, size)
        # numpy arrays have the buffer protocol; numpy's stubs declare it only from Python 3.12
        return [memoryview(cast("_Buffer", buf[o : o + n])) for o, n in zip(offs.tolist(), lens.tolist())]


def pull_route(
    channel: TcpChannel,
    read: ReadRequest,
    spans: np.ndarray,
    num_layers: int,
    deadline: float,
    config: DisaggConfig,
    buffer: Buffer,
    landed: Landed,
    *,
    src_unit: int,
) -> None:
    """Read ``read`` (``spans``: the route's ``[src, dst, nbytes]`` rows) until KV_DONE is
    COMMITTED. Each layer's bytes land in place, at the destination offsets of ``buffer(layer)``
    (no staging copy); ``landed(layer)`` runs once they all arrived and were verified. Raises
    RemoteError subclasses (ProtocolError when the producer's answers do not fit the plan); a
    failed pull may have written part of a layer's destination spans."""
    route = _Route(spans[:, 0], spans[:, 1], spans[:, 2], route_digest(spans))
    total = int(route.lengths.sum()) if not read.notify_only else 0
    opening = KvOpen(channel.new_request_id(), read)
    if total and channel.local_route():  # KV_OPEN goes out ahead of the first pulls: no round trip of its own
        piece = min(_local_piece(route, total, config, src_unit), _frame_room(channel, config))
        idle = config.io_timeout_s
        done = _copy_local(channel, opening, num_layers, route, total, piece, deadline, idle, buffer, landed)
    else:
        _opened(channel, channel.request(opening, timeout=_left(deadline, channel)), total, route.digest)
        done = (0, [])
    if total:
        _layers_tcp(channel, done, num_layers, route, total, deadline, config, buffer, landed)
    reply = channel.request(
        KvDone(channel.new_request_id()), timeout=min(_left(deadline, channel), config.io_timeout_s)
    )
    if not isinstance(reply, ev.CommitReply) or reply.status is not ev.CommitStatus.COMMITTED:
        raise RemoteError(f"producer did not count this read: {getattr(reply, 'message', '')}", peer=channel.peer)


def _opened(channel: TcpChannel, answer: object, total: int, digest: int) -> None:
    """KV_OPENED must name this side's route: its bytes and its rows' digest (a producer that
    planned other spans of the same total would have its bytes land in other places)."""
    if not isinstance(answer, KvOpened) or (answer.route_bytes, answer.route_digest) != (total, digest):
        raise ProtocolError(
            "KV_OPENED does not match the plan", fault=ProtocolFault.MALFORMED, peer=channel.peer, expected=total
        )


def _layers_tcp(
    channel: TcpChannel,
    done: tuple[int, list[int]],
    num_layers: int,
    route: _Route,
    total: int,
    deadline: float,
    config: DisaggConfig,
    buffer: Buffer,
    landed: Landed,
) -> None:
    """Over TCP: every layer, or those left (``done``: layers landed, layer ids KV_NEXT named
    so far) when a same-host read was refused, in one pipeline: a layer's KV_NEXT goes out
    right behind the pulls of the layer before it and its own pulls right behind that, their
    destinations resolved (:class:`Later`) once KV_NEXT's answer, read first, named the layer —
    no round trip and no drained window between layers (the producer answers in order)."""
    landed_n, told = done
    known = len(told)
    pieces = _pieces(total, min(config.chunk_bytes, _frame_room(channel, config)))
    then: dict[int, Callable[[object], None]] = {}  # request id -> what its answer does

    def requests() -> Iterator[tuple[ev.Request, object]]:
        for n in range(landed_n, num_layers):
            if n >= known:
                ask = KvNext(channel.new_request_id(), n)
                then[ask.request_id] = lambda answer: _told(channel, answer, told, num_layers)
                yield ask, None
            for i, (off, size) in enumerate(pieces):
                pull = KvPull(channel.new_request_id(), n, off, size)
                if i == len(pieces) - 1:
                    then[pull.request_id] = _landing(landed, told, n)
                yield pull, _dests_later(route, buffer, told, n, off, size)

    def on_answer(request_id: int, answer: object) -> None:
        action = then.pop(request_id, None)
        if action is not None:
            action(answer)

    left = _left(deadline, channel)
    channel.pipeline(requests(), window=config.window, timeout=left, idle=config.io_timeout_s, landed=on_answer)


def _landing(landed: Landed, told: list[int], n: int) -> Callable[[object], None]:
    """What the answer to the last pull of the ``n``-th ready layer does: report that layer."""
    return lambda _answer: landed(told[n])


def _dests_later(route: _Route, buffer: Buffer, told: list[int], n: int, off: int, size: int) -> Later:
    """Where route bytes ``[off, off+size)`` of the ``n``-th ready layer land, resolved once
    KV_NEXT ``n``'s answer named the layer."""
    return Later(lambda: route.dests(buffer(told[n]), off, size))


def _told(channel: TcpChannel, answer: object, told: list[int], num_layers: int) -> None:
    layer = answer.layer if isinstance(answer, KvLayer) else -1
    if not 0 <= layer < num_layers or layer in told:
        raise ProtocolError("unexpected layer", fault=ProtocolFault.UNEXPECTED, peer=channel.peer, layer=layer)
    told.append(layer)


def _frame_room(channel: TcpChannel, config: DisaggConfig) -> int:
    """The most one pull may ask for: both ends' ``max_frame_size`` (the producer's from the
    handshake, at least ``MIN_FRAME_SIZE``; a DATA answer has no metadata). A producer configured
    lower than this consumer gets smaller pulls instead of refusing them."""
    return min(channel.info.max_frame or config.protocol.max_frame_size, config.protocol.max_frame_size)


def _pieces(total: int, chunk: int) -> list[tuple[int, int]]:
    return [(off, min(chunk, total - off)) for off in range(0, total, chunk)]


def _copy_local(
    channel: TcpChannel,
    opening: KvOpen,
    num_layers: int,
    route: _Route,
    total: int,
    piece_bytes: int,
    deadline: float,
    idle: float,
    buffer: Buffer,
    landed: Landed,
) -> tuple[int, list[int]]:
    """Copy every layer out of the producer's memory as one stream of requests (:class:`_Asks`):
    KV_OPEN, then each layer's KV_NEXT behind the previous layer's pulls (the producer answers in
    order), each pull ``piece_bytes`` (:func:`_local_piece`; the bytes do not travel in it), its
    answer within ``idle`` seconds (KV_OPEN's and KV_NEXT's may take until ``deadline``).
    Returns (layers landed, layer ids KV_NEXT named): all of them, or where the copy was refused
    and route AUTO falls back to TCP (route LOCAL raises)."""
    asks = _Asks(channel, num_layers, total, piece_bytes)
    asks.send([opening], deadline)
    landed_n = 0
    while landed_n < num_layers:
        req, n, piece = asks.sent.popleft()
        left = _left(deadline, channel)  # a pull's answer should not wait: within idle
        try:
            answer = channel.next_answer(req.request_id, timeout=left if piece is None else min(left, idle))
        except RequestError as exc:  # the producer may not count this reader as same-host (NAT)
            refused = refusal(exc, channel.peer)
            if piece is None or refused is None:
                raise
            asks.drain(deadline)
            channel.local_refused(refused)
            return n, asks.told
        if n < 0:
            _opened(channel, answer, total, route.digest)
        elif piece is None:
            _told(channel, answer, asks.told, num_layers)
        else:
            asks.pulls_out -= 1
            try:
                _verified_copy(channel, answer, route, buffer(asks.told[n]), cast(KvPullLocal, req))
            except LocalReadError as exc:
                asks.drain(deadline)
                channel.local_refused(exc)
                return n, asks.told
            if piece[0] + piece[1] == total:
                landed(asks.told[n])
                landed_n += 1
            asks.send([], deadline)
    return num_layers, asks.told


class _Asks:
    """The requests of a same-host copy: those sent and not yet answered (oldest first, as
    ``(request, layer or -1 for KV_OPEN, piece or None for KV_NEXT)``), and what to send next.
    At most ``_LOCAL_WINDOW`` pulls are out (a piece the producer gathered stays in one of two
    buffers it alternates); KV_NEXTs go out ahead of them."""

    def __init__(self, channel: TcpChannel, num_layers: int, total: int, piece_bytes: int) -> None:
        self.channel, self.num_layers = channel, num_layers
        pieces = _pieces(total, piece_bytes)
        self.plan = [item for n in range(num_layers) for item in [(n, None), *((n, p) for p in pieces)]]
        self.sent: collections.deque[tuple[KvOpen | KvNext | KvPullLocal, int, tuple[int, int] | None]] = (
            collections.deque()
        )
        self.told: list[int] = []  # layer ids in the order KV_NEXT named them
        self.at = self.pulls_out = 0

    def send(self, first: list[KvOpen], deadline: float) -> None:
        """Send ``first`` and what the plan allows now, in one write (one wake-up of the producer)."""
        reqs: list[KvOpen | KvNext | KvPullLocal] = list(first)
        self.sent.extend((req, -1, None) for req in first)
        while self.at < len(self.plan) and (self.plan[self.at][1] is None or self.pulls_out < _LOCAL_WINDOW):
            n, piece = self.plan[self.at]
            rid = self.channel.new_request_id()
            req = KvNext(rid, n) if piece is None else KvPullLocal(rid, n, *piece)
            reqs.append(req)
            self.sent.append((req, n, piece))
            self.pulls_out += piece is not None
            self.at += 1
        if reqs:
            self.channel.send_many(reqs, timeout=_left(deadline, self.channel))

    def drain(self, deadline: float) -> None:
        """Read the answers still in flight (a copy was refused), keeping the layers KV_NEXT names."""
        for req, _n, piece in self.sent:
            try:
                later = self.channel.next_answer(req.request_id, timeout=_left(deadline, self.channel))
            except RequestError as exc:  # a pull refused like the one before it
                if piece is None or refusal(exc, self.channel.peer) is None:
                    raise
                continue
            if piece is None:
                _told(self.channel, later, self.told, self.num_layers)


def _local_piece(route: _Route, total: int, config: DisaggConfig, src_unit: int) -> int:
    """Bytes per KV_PULL_LOCAL. Where the producer gathers the route's small spans into its two
    staging buffers: ``chunk_bytes`` (staging stays bounded per reader). Else as much as one
    answer may describe: the producer cuts the spans at its ``src_unit`` block regions, so a
    piece of P bytes whose spans average >= ZERO_COPY_AVG has at most P / ZERO_COPY_AVG +
    P / src_unit regions; both terms are kept within half of ``max_keys`` (a LOCAL_REPLY with
    more regions is refused), and at most _LOCAL_PIECE_MAX."""
    keys = max(config.protocol.max_keys // 2, 1)
    gathered = total // max(route.lengths.size, 1) < ZERO_COPY_AVG
    want = config.chunk_bytes if gathered else max(config.chunk_bytes, _LOCAL_PIECE_MAX)
    return min(want, keys * ZERO_COPY_AVG, keys * max(src_unit, 1))


def _verified_copy(channel: TcpChannel, reply: object, route: _Route, buf: np.ndarray, pull: KvPullLocal) -> None:
    """Regions copied straight into the destination spans when each lies inside one (the
    producer sent views of its layer, cut at its block boundaries); gathered regions land in a
    staging piece first and are scattered once verified. Placed with arrays: no Python object
    per region."""
    if not isinstance(reply, ev.LocalReply):
        raise ProtocolError("expected LOCAL_REPLY", fault=ProtocolFault.UNEXPECTED, peer=channel.peer)
    if np.any(reply.regions[:, 1] > pull.length):  # a hostile length, before any arithmetic on it
        raise ProtocolError("LOCAL_REPLY region longer than the pull", fault=ProtocolFault.MALFORMED, peer=channel.peer)
    lengths = reply.regions[:, 1].astype(np.int64)
    if int(lengths.sum()) != pull.length:
        raise ProtocolError("LOCAL_REPLY does not cover the pull", fault=ProtocolFault.MALFORMED, peer=channel.peer)
    starts = np.cumsum(lengths) - lengths  # each region's place in the pull's bytes
    offs, lens = route_slice(route.dst, route.lengths, pull.offset, pull.length)
    placed = _placed(starts, lengths, offs, lens)
    if placed is not None:
        return channel.local_copy_at(reply, buf, placed)
    staging = np.empty(pull.length, np.uint8)
    channel.local_copy_at(reply, staging, starts)
    scatter(buf, offs, lens, staging)
    return None


def _placed(starts: np.ndarray, lengths: np.ndarray, offs: np.ndarray, lens: np.ndarray) -> np.ndarray | None:
    """Where each region (at ``starts`` in the pull's bytes) lands in the layer: inside the
    destination span (``offs``, ``lens``) holding its first byte, or None when one would
    straddle two spans."""
    if not lens.size:
        return None
    ends = np.cumsum(lens)
    span = np.minimum(np.searchsorted(ends, starts, side="right"), lens.size - 1)
    if np.any(starts + lengths > ends[span]):
        return None
    placed: np.ndarray = offs[span] + (starts - (ends[span] - lens[span]))
    return placed


def _left(deadline: float, channel: TcpChannel) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise NetTimeoutError("read deadline passed", peer=channel.peer)
    return left
