"""Serving span GETs on the one tiersync server: a trainer shard's and a relaying sampler's.

:class:`SpanService` is the :class:`~tiersync.net.service.Service` of both: it answers
``W_GET`` (:mod:`tiersync.weights.ops`) with DATA carrying the span's bytes (views of the
holder's buffer sent without a copy, or gathered when the span is many small rows), or ERROR
when the provider refuses (stale version, unknown tensor, not there in time, span out of
range). ``W_SUMS`` (a delta sync asking a trainer shard which chunks changed) is answered
with the same per-span checksums DATA carries, computed once per span and version (a trainer
shard's ``summer`` composes them from sums taken while the version was written, without
reading the bytes again).
Anything else goes to ``control`` (a trainer shard's registrations and acks).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import TYPE_CHECKING, cast

import numpy as np

from tiersync.errors import TierSyncError, UsageError
from tiersync.net import events as ev
from tiersync.net.errors import ProtocolError, ProtocolFault
from tiersync.net.frames import SUPPORTED, PayloadChecksum
from tiersync.net.pieces import sum_of
from tiersync.net.service import Park, Service, Session, Watch
from tiersync.weights.executor import span_view
from tiersync.weights.ops import WEIGHTS, Get, Sums, SumsReply
from tiersync.weights.spans import StridedSpan

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["Provider", "SpanService", "Summer", "span_payload"]

Provider = Callable[[int, str, tuple[int, ...], StridedSpan | None], "tuple[np.ndarray, Callable[[], None]] | Watch"]
"""``(version, tensor, key, span) -> (flat uint8 local shard, release)`` once that tensor
(chunk ``key`` of it, for a relay, which serves only the ``span`` it landed that chunk in; None
for a W_SUMS) of that version is there, else a :data:`~tiersync.net.service.Watch` of it (the
GET's session is parked meanwhile, with no server worker); ``release()`` runs once the answer
was written (the bytes must not change before; a pinned answer's bytes are read later still:
see :class:`SpanService`). Raises a TierSyncError to refuse."""

Summer = Callable[[int, str, StridedSpan], "int | None"]
"""``(version, tensor, span) -> tsum64 of the span's bytes``, or None when not known (the span
is then summed from its bytes)."""

_ROWS_SENT_AS_IOVEC = 256  # strided spans of at most this many rows of >= 64 KiB go out zero-copy
_MAX_SUMS = 1 << 16  # cached span checksums (one version's chunks)
_WAIT_S = 30.0  # most a GET waits for another's sum of its span before summing it itself

_GATHER_BYTES = 1 << 30  # most bytes of gathered copies a server keeps at once (GETs past it wait)
_MAX_INCARNATIONS = 1 << 10  # trainer processes (shards, restarts) whose newest version's sums are kept
_Key = tuple[int, int, str, StridedSpan]  # (incarnation, version, tensor, span): one cached checksum


def span_payload(shard: np.ndarray, span: StridedSpan) -> list[memoryview]:
    """Byte views of ``span`` in ``shard`` (flat uint8), in C order; a gathered copy when the
    span has many small rows. ProtocolError (OVERSIZE) when it reaches past the shard."""
    if span.extent > shard.size:
        raise ProtocolError(
            "span reaches past the shard", fault=ProtocolFault.OVERSIZE, extent=span.extent, nbytes=shard.size
        )
    # numpy arrays export the buffer protocol; its stubs do not say so (hence the casts)
    if span.is_contiguous:
        return [memoryview(cast("Buffer", shard[span.offset : span.offset + span.row_bytes]))]
    if _in_place(span):
        return [memoryview(cast("Buffer", shard[o : o + n])) for o, n in span.rows()]
    return [memoryview(cast("Buffer", np.ascontiguousarray(span_view(shard, span)).reshape(-1)))]


def _in_place(span: StridedSpan) -> bool:
    """Whether :func:`span_payload` sends views of the shard (not a gathered copy)."""
    return span.is_contiguous or (span.row_count <= _ROWS_SENT_AS_IOVEC and span.row_bytes >= 64 << 10)


class _Sums:
    """Payload checksums of the newest version's spans, computed once for every receiver that
    GETs the span (replicated samplers ask for the same ones, usually at the same moment: a
    GET for a span being summed waits for that sum instead of summing it again). Sound for
    pinned bytes only (a trainer shard's: a version's bytes never change while it is served)
    and because each trainer process's versions only grow: sums are kept per trainer
    incarnation (a restarted trainer numbers its versions again, with other bytes), for its
    newest version. The stack sends a known sum only when it is of the connection's algorithm
    (this build's first choice: almost always)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sums: dict[_Key, int] = {}
        self._busy: dict[_Key, threading.Event] = {}  # being summed -> set when known
        self._newest: dict[int, int] = {}  # incarnation -> the version whose sums are kept

    def of(
        self, get: Get | Sums, payload: list[memoryview], span: StridedSpan | None = None
    ) -> tuple[PayloadChecksum, int]:
        if span is None:
            if not isinstance(get, Get):
                raise UsageError("the checksum of a W_SUMS span needs that span", argument="span")
            span = get.span
        key, algo = (get.incarnation, get.version, get.tensor, span), SUPPORTED[0]
        with self._lock:
            known, busy = self._sums.get(key), self._busy.get(key)
            mine = known is None and busy is None and get.version >= self._newest.get(get.incarnation, -1)
            if mine:
                busy = self._busy[key] = threading.Event()
        if known is not None:
            return algo, known
        if not mine and busy is not None and busy.wait(_WAIT_S):
            with self._lock:
                known = self._sums.get(key)
            if known is not None:
                return algo, known
        try:
            value = sum_of(algo, payload)
        except BaseException:
            if mine:  # waiters wake even when summing failed (they then sum it themselves)
                self._keep(key, None)
            raise
        if mine:
            self._keep(key, value)
        return algo, value

    def _keep(self, key: _Key, value: int | None) -> None:
        incarnation, version = key[0], key[1]
        with self._lock:
            if len(self._sums) >= _MAX_SUMS or len(self._newest) >= _MAX_INCARNATIONS:
                self._sums.clear()
                self._newest.clear()
            newest = self._newest.get(incarnation, -1)
            if version > newest:  # that trainer process moved on: its older sums go
                self._sums = {k: v for k, v in self._sums.items() if k[0] != incarnation}
                self._newest[incarnation] = newest = version
            if version == newest and value is not None:
                self._sums[key] = value
            busy = self._busy.pop(key)
        busy.set()


class _Gathering:
    """Bytes of gathered copies alive (answers of strided spans of many rows, held until
    written, so a peer that does not read keeps its copy): at most ``limit``, or one copy. A
    GET that would pass it waits (:meth:`watch`); a copy freed wakes every waiting GET (one
    woken for the room freed may have gone meanwhile: its wake would be lost)."""

    def __init__(self, limit: int) -> None:
        self._lock, self._limit, self._used = threading.Lock(), limit, 0
        self._wakes: list[Callable[[], object]] = []

    def take(self, nbytes: int) -> bool:
        with self._lock:
            if not self._fits(nbytes):
                return False
            self._used += nbytes
            return True

    def give(self, nbytes: int) -> None:
        with self._lock:
            self._used -= nbytes
            wakes, self._wakes = self._wakes, []
        for wake in wakes:
            wake()

    def watch(self, nbytes: int, wake: Callable[[], object]) -> None:
        with self._lock:
            if not self._fits(nbytes):
                self._wakes.append(wake)
                return
        wake()

    def _fits(self, nbytes: int) -> bool:
        return not self._used or self._used + nbytes <= self._limit


class SpanService(Service):
    """Answers GETs from ``provider`` (waiting at most ``timeout_s`` for the bytes); other
    messages go to ``control(session, event) -> answers``, session ends to ``ended(session)``;
    ``summer`` knows spans' checksums without reading them (a trainer shard's version buffer).
    ``pinned``: the provider's bytes of a version stay unchanged until its GETs were read, not
    only answered (a trainer shard's buffer: the next version begins once every sampler
    acknowledged this one, timed out or left; one still reading then refuses what changed,
    BAD_CHECKSUM), so DATA of views of them is :attr:`~tiersync.net.events.Data.pinned` (no
    copy into the kernel on plain TCP) and their checksums are kept per version and span (a
    relay's, not pinned, are summed per GET). ``serving(version)``: whether the provider still
    serves ``version``; a GET is refused when it no longer does once its checksum was taken
    (from bytes the next version may have begun to overwrite). ``incarnation``: a trainer
    shard's; a GET or W_SUMS naming another is refused (None: a relay, which serves any).
    ``gather_bytes``: the most bytes of gathered copies (strided spans of many rows) alive at
    once; a GET past it waits for room, refused CAPACITY at ``timeout_s``."""

    vocabulary = WEIGHTS

    def __init__(
        self,
        provider: Provider,
        timeout_s: float,
        control: Callable[[Session, object], Iterable[object]] | None = None,
        ended: Callable[[Session], None] | None = None,
        summer: Summer | None = None,
        pinned: bool = False,
        serving: Callable[[int], bool] | None = None,
        incarnation: int | None = None,
        gather_bytes: int = _GATHER_BYTES,
    ) -> None:
        self._provider, self._timeout, self._incarnation = provider, timeout_s, incarnation
        self._control, self._ended, self._summer = control, ended, summer
        self._pinned, self._serving = pinned, serving
        self._sums, self._gathering = _Sums(), _Gathering(gather_bytes)

    def handle(self, session: Session, event: object) -> Iterable[object] | Park:
        if isinstance(event, (Get, Sums)) and self._incarnation not in (None, event.incarnation):
            text = f"this trainer shard restarted: incarnation {self._incarnation:x}, not {event.incarnation:x}"
            return [ev.Error(event.request_id, ev.ErrorCode.NOT_FOUND, text)]
        if isinstance(event, Get):
            return self._get(event)
        if isinstance(event, Sums) and self._control is not None:  # trainer shards only
            return self._checksums(event)
        if self._control is None:
            session.close()  # a data-only server: a control message is out of place
            return []
        return self._control(session, event)

    def closed(self, session: Session) -> None:
        if self._ended is not None:
            self._ended(session)

    def _provided(
        self, req: Get | Sums, key: tuple[int, ...], span: StridedSpan | None
    ) -> tuple[np.ndarray, Callable[[], None]] | list[object]:
        """The provider's bytes for ``req`` (release them); else its answers: [Park] while they
        are not there, for at most ``timeout_s`` from the request's first park (:attr:`Park.late`),
        or [ERROR] (a ValueError of a GET: BAD_REQUEST; anything else NOT_FOUND)."""
        got: tuple[np.ndarray, Callable[[], None]] | Watch | list[object]
        try:
            got = self._provider(req.version, req.tensor, key, span)
            if not isinstance(got, tuple):  # the server keeps the first park's deadline
                late = (ev.Error(req.request_id, ev.ErrorCode.NOT_FOUND, f"not there in time ({self._timeout} s)"),)
                return [Park(got, time.monotonic() + self._timeout, late)]
        except TierSyncError as exc:
            code = (
                ev.ErrorCode.BAD_REQUEST
                if isinstance(req, Get) and isinstance(exc, ValueError)
                else ev.ErrorCode.NOT_FOUND
            )
            got = [ev.Error(req.request_id, code, exc.message[:512])]
        return got

    def _get(self, get: Get) -> Iterator[object]:
        """DATA (written before the provider's ``release`` runs: a generator's answer is sent
        before the server asks it for more), ERROR, or Park while the bytes are not there."""
        got = self._provided(get, get.key, get.span)
        if isinstance(got, list):
            yield from got
            return
        shard, release = got
        gathered = 0 if _in_place(get.span) else get.span.nbytes
        if gathered and not self._gathering.take(gathered):  # too many copies alive: wait for room
            release()
            busy = ev.Error(get.request_id, ev.ErrorCode.CAPACITY, f"no room to gather in time ({self._timeout} s)")
            yield Park(partial(self._gathering.watch, gathered), time.monotonic() + self._timeout, (busy,))
            return
        try:
            payload = span_payload(shard, get.span)
            pinned = self._pinned and not gathered  # never a gathered copy: freed once sent
            checksum = self._sum(get, payload, get.span)
            if self._serving is not None and not self._serving(get.version):
                yield ev.Error(get.request_id, ev.ErrorCode.NOT_FOUND, "the version moved on while it was summed")
                return
            yield ev.Data(get.request_id, payload, checksum, pinned=pinned)
        except ProtocolError as exc:
            yield ev.Error(get.request_id, ev.ErrorCode.BAD_REQUEST, exc.message[:512])
        finally:
            try:
                release()
            finally:
                if gathered:  # its copy is written, or its session ended
                    self._gathering.give(gathered)

    def _checksums(self, req: Sums) -> Iterator[object]:
        """W_SUMS_REPLY with the checksum of every span (the ones DATA of a GET would carry), or
        ERROR. The spans may cover at most the tensor's bytes in all (a sampler asks for its
        chunks of it): one request never makes the trainer read more than a GET of all of it."""
        got = self._provided(req, (), None)
        if isinstance(got, list):
            yield from got
            return
        shard, release = got
        try:
            if sum(s.nbytes for s in req.spans) > shard.nbytes:  # a few bytes asking to read the tensor many times
                yield ev.Error(
                    req.request_id, ev.ErrorCode.BAD_REQUEST, "W_SUMS spans cover more bytes than the tensor"
                )
                return
            sums = [self._sum(req, span_payload(shard, s), s) for s in req.spans]
            if self._serving is not None and not self._serving(req.version):  # as in _get
                yield ev.Error(req.request_id, ev.ErrorCode.NOT_FOUND, "the version moved on while it was summed")
                return
            yield SumsReply(req.request_id, int(sums[0][0]), tuple(v for _, v in sums))
        except ProtocolError as exc:
            yield ev.Error(req.request_id, ev.ErrorCode.BAD_REQUEST, exc.message[:512])
        finally:
            release()

    def _sum(self, req: Get | Sums, payload: list[memoryview], span: StridedSpan) -> tuple[PayloadChecksum, int]:
        """The checksum of ``span``'s ``payload``: the summer's when it knows it, else summed once
        per span and version (:class:`_Sums`) when the bytes are pinned, else summed each time
        (a relay's chunk lands again when it differed from the trainer's: a sum kept from before
        would make every later GET of it fail BAD_CHECKSUM)."""
        known = None if self._summer is None else self._summer(req.version, req.tensor, span)
        if known is not None:
            return PayloadChecksum.TSUM64, known
        if not self._pinned:
            return SUPPORTED[0], sum_of(SUPPORTED[0], payload)
        return self._sums.of(req, payload, span)
