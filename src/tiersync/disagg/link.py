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

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tiersync.disagg.config import DisaggConfig
from tiersync.disagg.messages import ReadRequest
from tiersync.disagg.ops import KvDone, KvLayer, KvNext, KvOpen, KvOpened, KvPull, KvPullLocal
from tiersync.disagg.spanio import route_slice, scatter
from tiersync.errors import RemoteError
from tiersync.net import events as ev
from tiersync.net.errors import NetTimeoutError, ProtocolError, ProtocolFault
from tiersync.net.local import LocalReadError
from tiersync.net.tcp import TcpChannel

__all__ = ["pull_route"]

Buffer = Callable[[int], np.ndarray]
Landed = Callable[[int], None]
_LOCAL_WINDOW = 2  # the producer alternates two gather buffers: never more in flight


@dataclass(frozen=True, slots=True)
class _Route:
    """The route's spans: source offsets, destination offsets, lengths (one row per span)."""

    src: np.ndarray
    dst: np.ndarray
    lengths: np.ndarray

    def dests(self, buf: np.ndarray, offset: int, size: int) -> list[memoryview]:
        """Views of ``buf`` (the destination layer) that receive route bytes ``[offset, offset+size)``."""
        offs, lens = route_slice(self.dst, self.lengths, offset, size)
        return [memoryview(buf[o : o + n]) for o, n in zip(offs.tolist(), lens.tolist())]


def pull_route(
    channel: TcpChannel,
    read: ReadRequest,
    spans: np.ndarray,
    num_layers: int,
    deadline: float,
    config: DisaggConfig,
    buffer: Buffer,
    landed: Landed,
) -> None:
    """Read ``read`` (``spans``: the route's ``[src, dst, nbytes]`` rows) until KV_DONE is
    COMMITTED. Each layer's bytes land in place, at the destination offsets of ``buffer(layer)``
    (no staging copy); ``landed(layer)`` runs once they all arrived and were verified. Raises
    RemoteError subclasses (ProtocolError when the producer's answers do not fit the plan); a
    failed pull may have written part of a layer's destination spans."""
    route = _Route(spans[:, 0], spans[:, 1], spans[:, 2])
    total = int(route.lengths.sum()) if not read.notify_only else 0
    opened = channel.request(KvOpen(channel.new_request_id(), read), timeout=_left(deadline, channel))
    if not isinstance(opened, KvOpened) or opened.route_bytes != total:
        raise ProtocolError(
            "KV_OPENED does not match the plan", fault=ProtocolFault.MALFORMED, peer=channel.peer, expected=total
        )
    if total:
        _layers(channel, num_layers, route, total, deadline, config, buffer, landed)
    reply = channel.request(KvDone(channel.new_request_id()), timeout=_left(deadline, channel))
    if not isinstance(reply, ev.CommitReply) or reply.status is not ev.CommitStatus.COMMITTED:
        raise RemoteError(f"producer did not count this read: {getattr(reply, 'message', '')}", peer=channel.peer)


def _layers(
    channel: TcpChannel,
    num_layers: int,
    route: _Route,
    total: int,
    deadline: float,
    config: DisaggConfig,
    buffer: Buffer,
    landed: Landed,
) -> None:
    told: list[int] = []  # layer ids in the order KV_NEXT named them
    done = (
        _copy_local(channel, num_layers, route, total, deadline, config, buffer, landed, told)
        if channel.local_route()
        else 0
    )
    for n in range(done, num_layers):  # over TCP: every layer, or those left when a same-host read was refused
        if n == len(told):
            _told(
                channel,
                channel.request(KvNext(channel.new_request_id(), n), timeout=_left(deadline, channel)),
                told,
                num_layers,
            )
        _pull_tcp(channel, n, route, buffer(told[n]), total, deadline, config)
        landed(told[n])


def _told(channel: TcpChannel, answer: object, told: list[int], num_layers: int) -> None:
    layer = answer.layer if isinstance(answer, KvLayer) else -1
    if not 0 <= layer < num_layers or layer in told:
        raise ProtocolError("unexpected layer", fault=ProtocolFault.UNEXPECTED, peer=channel.peer, layer=layer)
    told.append(layer)


def _pieces(total: int, chunk: int) -> list[tuple[int, int]]:
    return [(off, min(chunk, total - off)) for off in range(0, total, chunk)]


def _pull_tcp(
    channel: TcpChannel, n: int, route: _Route, buf: np.ndarray, total: int, deadline: float, config: DisaggConfig
) -> None:
    """Each pull's DATA is received straight into its destination spans (the native receiver
    scatters it, GIL released, then verifies the checksum)."""
    pulls = [
        (KvPull(channel.new_request_id(), n, off, size), route.dests(buf, off, size))
        for off, size in _pieces(total, config.chunk_bytes)
    ]
    channel.pipeline(pulls, window=config.window, timeout=_left(deadline, channel))


def _copy_local(
    channel: TcpChannel,
    num_layers: int,
    route: _Route,
    total: int,
    deadline: float,
    config: DisaggConfig,
    buffer: Buffer,
    landed: Landed,
    told: list[int],
) -> int:
    """Copy every layer out of the producer's memory as one stream of requests: each layer's
    KV_NEXT goes out behind the previous layer's pulls (the producer answers in order), at
    most two pulls in flight (a piece it gathered stays in one of two buffers it alternates).
    Returns the layers landed: all of them, or where the copy was refused and route AUTO
    falls back to TCP (route LOCAL raises); layers already named are in ``told``."""
    plan = [
        item for n in range(num_layers) for item in [(n, None), *((n, p) for p in _pieces(total, config.chunk_bytes))]
    ]
    sent: list = []  # (request, n, piece or None), oldest first
    pulls_out, at, landed_n = 0, 0, 0
    while landed_n < num_layers:
        while at < len(plan) and (plan[at][1] is None or pulls_out < _LOCAL_WINDOW):
            n, piece = plan[at]
            req = (
                KvNext(channel.new_request_id(), n)
                if piece is None
                else KvPullLocal(channel.new_request_id(), n, *piece)
            )
            channel.send(req, timeout=_left(deadline, channel))
            sent.append((req, n, piece))
            pulls_out += piece is not None
            at += 1
        req, n, piece = sent.pop(0)
        answer = channel.next_answer(req.request_id, timeout=_left(deadline, channel))
        if piece is None:
            _told(channel, answer, told, num_layers)
            continue
        pulls_out -= 1
        try:
            _verified_copy(channel, answer, route, buffer(told[n]), req)
        except LocalReadError as exc:
            for rest, _m, p in sent:  # answers still in flight
                later = channel.next_answer(rest.request_id, timeout=_left(deadline, channel))
                if p is None:
                    _told(channel, later, told, num_layers)
            channel.local_refused(exc)
            return n
        if piece[0] + piece[1] == total:
            landed(told[n])
            landed_n += 1
    return num_layers


def _verified_copy(channel: TcpChannel, reply: object, route: _Route, buf: np.ndarray, pull: KvPullLocal) -> None:
    """Regions copied straight into the destination spans when each lies inside one (the
    producer sent views of its layer, cut at its block boundaries); a gathered region lands in a staging piece first
    and is scattered once verified."""
    if not isinstance(reply, ev.LocalReply):
        raise ProtocolError("expected LOCAL_REPLY", fault=ProtocolFault.UNEXPECTED, peer=channel.peer)
    lengths = reply.regions[:, 1].tolist()
    if sum(lengths) != pull.length:
        raise ProtocolError("LOCAL_REPLY does not cover the pull", fault=ProtocolFault.MALFORMED, peer=channel.peer)
    pieces = _recut(route.dests(buf, pull.offset, pull.length), lengths)
    if pieces is not None:
        return channel.local_copy(reply, pieces)
    staging = np.empty(pull.length, np.uint8)
    pieces, pos = [], 0
    for length in lengths:
        pieces.append(memoryview(staging[pos : pos + length]))
        pos += length
    channel.local_copy(reply, pieces)
    offs, lens = route_slice(route.dst, route.lengths, pull.offset, pull.length)
    scatter(buf, offs, lens, staging)


def _recut(dests: list[memoryview], lengths: list[int]) -> list[memoryview] | None:
    """``dests`` cut into consecutive pieces of ``lengths`` (the producer splits spans at its
    block boundaries), or None when a region would straddle two destinations."""
    if [len(d) for d in dests] == lengths:
        return dests
    out, views, cur, pos = [], iter(dests), memoryview(b""), 0
    for n in lengths:
        while pos == len(cur) and n:
            cur, pos = next(views, None), 0
            if cur is None:
                return None
        if pos + n > len(cur):
            return None
        out.append(cur[pos : pos + n])
        pos += n
    return out if pos == len(cur) and not any(len(v) for v in views) else None


def _left(deadline: float, channel: TcpChannel) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise NetTimeoutError("read deadline passed", peer=channel.peer)
    return left
