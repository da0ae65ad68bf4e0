"""Prefill side: a request being served, a reader's route through it, and the answers to pulls.

:class:`LayerReads` answers one route's KV_PULL (views of the host buffer when the spans are few
or large, else gathered into a per-session staging buffer) and KV_PULL_LOCAL (same host: where
the bytes are in this process, each region checksummed, for ``process_vm_readv``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import numpy as np

from tiersync.disagg.blocksums import BlockSums, LayerSums
from tiersync.disagg.config import DisaggConfig, RequestState
from tiersync.disagg.geometry import PagedKVLayout
from tiersync.disagg.ops import KvPull, KvPullLocal
from tiersync.disagg.spanio import gather, route_slice
from tiersync.net import events as ev
from tiersync.net import local
from tiersync.net.frames import SUPPORTED, PayloadChecksum, payload_checksum
from tiersync.net.service import Session
from tiersync.tiers.shareable import SharedRegion, covering

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["LayerReads", "Outgoing", "Refused", "Route"]

_ZERO_COPY_SPANS = 256  # pulls of at most this many spans (or of large ones) go out as views
ZERO_COPY_AVG = 16 << 10  # ... spans this large on average; smaller ones are gathered into staging
_SPARE = 2  # staging buffers kept for the next reads once theirs ended (each up to a frame)
Code = ev.ErrorCode


class Refused(Exception):
    """A reader's request refused with ``code`` (answered as ERROR)."""

    def __init__(self, code: ev.ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(eq=False)
class Outgoing:
    """A registered request and the readers that joined it."""

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
    sessions: set[Session] = field(default_factory=set)
    sums: dict[int, LayerSums] = field(default_factory=dict)  # layer -> its block regions' sums and states
    waiters: list[Callable[[], object]] = field(default_factory=list)  # parked KV_NEXTs' wakes (producer's lock)

    def waits_for(self, n: int) -> bool:
        """Whether a reader's ``n``-th layer is not ready yet in a request still pending."""
        return self.state is RequestState.PENDING and len(self.ready) <= n


@dataclass(eq=False)
class Route:
    """One session's open request: what it reads (spans of a layer) and the layers it was told of."""

    req: Outgoing
    dst_rank: int
    offsets: np.ndarray
    lengths: np.ndarray
    told: list[int] = field(default_factory=list)
    counted: bool = False
    local_pulls: int = 0


class LayerReads:
    """Answers pulls of routes through ``layout``'s host layers (see the module doc)."""

    def __init__(self, layout: PagedKVLayout, config: DisaggConfig, shared: Iterable[SharedRegion] = ()) -> None:
        self.config = config
        self.shared = tuple(shared)  # memory same-host readers may map (named in LOCAL_REPLY)
        self.sums = BlockSums(layout, config.local_threads)
        self._lock = threading.Lock()
        self._staging: dict[tuple[int, int], np.ndarray] = {}  # (session id, slot) -> gather buffer
        self._spare: list[np.ndarray] = []  # gather buffers of reads that ended, at most _SPARE

    def forget(self, session: Session, *, reuse: bool = False) -> None:
        """The session's read ended: drop its staging buffers, or with ``reuse`` (its KV_DONE:
        every answer before it was written) keep them as spares the next reads take. A decode
        engine's pool keeps connections idle: their buffers must not stay with them. Those of
        a connection that closed are never reused: a pull of it may still be gathering."""
        with self._lock:
            for slot in (0, 1):
                buf = self._staging.pop((session.session_id, slot), None)
                if buf is not None and reuse:
                    self._spare = sorted([*self._spare, buf], key=len, reverse=True)[:_SPARE]

    def spans(self, route: Route, n: int, offset: int, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The ``n``-th ready layer's host buffer and the spans of the pull in it."""
        if n >= len(route.told):
            raise Refused(Code.BAD_REQUEST, f"the {n}-th ready layer was not asked for by KV_NEXT")
        if length > self.config.protocol.max_frame_size or offset + length > int(route.lengths.sum()):
            raise Refused(Code.BAD_REQUEST, "pull outside the route or over the frame size")
        return (route.req.views[route.told[n]], *route_slice(route.offsets, route.lengths, offset, length))

    def pull(self, session: Session, event: KvPull, route_of: Callable[[Session], Route]) -> Iterable[object]:
        """DATA: views of the host buffer when the spans are few or large, else gathered; its
        checksum composed from the layer's block sums when they are known (else the stack sums
        the bytes as it sends them)."""
        try:
            route = route_of(session)
            view, offs, lens = self.spans(route, event.n, event.offset, event.length)
        except Refused as exc:
            return [ev.Error(event.request_id, exc.code, str(exc)[:512])]
        known = self.sums.known(route.req, route.told[event.n]) if self.sums.enabled else None
        value = self.sums.composed(view, known, offs, lens)
        checksum = None if value is None else (PayloadChecksum.TSUM64, value)
        if lens.size <= _ZERO_COPY_SPANS or event.length // lens.size >= ZERO_COPY_AVG:
            views = [memoryview(cast("Buffer", view[o : o + n])) for o, n in zip(offs.tolist(), lens.tolist())]
            return [ev.Data(event.request_id, views, checksum)]
        staging = gather(view, offs, lens, out=self._staging_of(session, event.length, 0))
        return written_before_next(ev.Data(event.request_id, memoryview(cast("Buffer", staging)), checksum))

    def _staging_of(self, session: Session, nbytes: int, slot: int) -> np.ndarray:
        """The session's gather buffer ``slot``, at least ``nbytes`` (grown on demand, bounded
        by the frame size; a spare when there is one); kept while the session is open, spare or
        new (a same-host reader copies out of it after the answer went: only the slot's next
        pull may reuse it). It is marked closed before :meth:`forget` runs, so a pull that
        outlived its session leaves nothing behind."""
        key = (session.session_id, slot)
        with self._lock:
            buf = self._staging.get(key)
            if buf is None and self._spare:
                buf = self._spare.pop(0)  # the largest
            if buf is None or buf.size < nbytes:
                buf = np.empty(nbytes, np.uint8)
            if not session.closed:
                self._staging[key] = buf
            return buf[:nbytes]

    def pull_local(self, session: Session, route: Route, event: KvPullLocal) -> ev.LocalReply:
        """Where the bytes are in this process, each region checksummed (the reader copies
        those in :attr:`shared` memory out of a map of it, the others with
        ``process_vm_readv``, and verifies); many small spans are gathered first."""
        if not session.info.same_host:
            raise Refused(Code.UNSUPPORTED, "KV_PULL_LOCAL from another host")
        local.allow_readers()  # at the first same-host read, not at any same-host session's start
        view, offs, lens = self.spans(route, event.n, event.offset, event.length)
        algo = SUPPORTED[0]
        if not (lens.size <= _ZERO_COPY_SPANS or event.length // lens.size >= ZERO_COPY_AVG):
            route.local_pulls += 1  # two buffers in turn: the reader keeps at most two pulls in flight
            view = gather(view, offs, lens, out=self._staging_of(session, event.length, route.local_pulls % 2))
            offs, lens = np.zeros(1, np.int64), np.array([view.size], np.int64)
            sums = np.array([payload_checksum(algo, cast(memoryview, view))], np.uint64)  # it sums any buffer
        elif algo is PayloadChecksum.TSUM64:
            offs, lens, sums = self.sums.regions(view, self.sums.known(route.req, route.told[event.n]), offs, lens)
        else:  # each view as it is: payload_checksum sums any buffer, not only those it is typed for
            sums = np.array(
                [
                    payload_checksum(algo, cast(memoryview, view[o : o + n]))
                    for o, n in zip(offs.tolist(), lens.tolist())
                ],
                np.uint64,
            )
        base = local.buffer_address(view)[0]
        regions = np.stack([offs.astype(np.uint64) + np.uint64(base), lens.astype(np.uint64), sums], axis=1)
        return ev.LocalReply(event.request_id, os.getpid(), algo, regions, covering(self.shared, regions))


def written_before_next(answer: object) -> Iterator[object]:
    """A generator answer: the server sends what a handler yields before it reads on."""
    yield answer
