"""Block servers: the reader side of "the destination pulls", as one :class:`BlockService`.

A block server implements four methods — :meth:`~BlockService.lease` (validate and pin
keys, all-or-nothing; TTL clamped to [30, 600] s), :meth:`~BlockService.view` (a zero-copy
view of a range under a lease), :meth:`~BlockService.release` and :meth:`~BlockService.holds`
(whether a lease has not ended: a connection at its lease cap counts only those) — and
optionally :meth:`~BlockService.offer` and, where a server can do better than a loop over
:meth:`~BlockService.view`, :meth:`~BlockService.views` (many ranges of one lease at once)
and :meth:`~BlockService.regions` (where they lie for a same-host reader). The base
answers the wire: PING,
READ_LEASE, PULL, PULL_MANY (one DATA carrying every range, gathered without a copy; of whole
blocks, its checksum composed from theirs by :class:`~tiersync.net.partials.PartialSums`),
PULL_LOCAL (same-host peers: where the ranges are, with their checksums, for
``process_vm_readv``, and the sealed memfd that holds them where the server's memory is one a
reader may map: ``shared``) and RELEASE.
Leases belong to the session that took them: when the session ends, however it ends,
every lease it still holds is released, so a reader killed mid-read pins nothing.
:class:`MemoryBlockSource` serves an in-memory dict (the writer side of an offer).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Container, Iterable, Mapping
from typing import TYPE_CHECKING, cast

import numpy as np

from tiersync.net import events as ev
from tiersync.net import local
from tiersync.net import store_ops as so
from tiersync.net.deadlines import Deadlines
from tiersync.net.frames import SUPPORTED, PayloadChecksum, payload_checksum
from tiersync.net.partials import ChangedBlock, PartialSums
from tiersync.net.service import Park, Service, Session
from tiersync.tiers.shareable import SharedRegion, check_shared, covering

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "LEASE_TTL_MAX_S",
    "LEASE_TTL_MIN_S",
    "BlockError",
    "BlockService",
    "MemoryBlockSource",
    "clamp_ttl",
    "new_lease_id",
]

LEASE_TTL_MIN_S, LEASE_TTL_MAX_S = 30, 600


def new_lease_id(taken: Container[int]) -> int:
    """A lease id no one can predict (63 random bits, never 0) and not in ``taken``: a lease is a
    bearer capability shared by the streams of one reader, so a peer that holds the token must
    not reach another reader's lease by counting (ids were sequential)."""
    while True:
        lease_id = secrets.randbits(63)
        if lease_id and lease_id not in taken:
            return lease_id


def clamp_ttl(ttl_s: int) -> int:
    return min(max(ttl_s, LEASE_TTL_MIN_S), LEASE_TTL_MAX_S)


MAX_LEASED_KEYS = 1 << 20
"""Keys under lease at once, over every connection, in a block server (each lease holds its keys)."""

MAX_SESSION_LEASES = 1024
"""Leases one connection may hold at once (each pins up to 4096 blocks until released, its TTL
or the connection's end): a reader needs a few; more are refused CAPACITY."""
_TOO_MANY_LEASES = f"this connection holds {MAX_SESSION_LEASES} leases: release some first"


def _fits(session: Session, event: object) -> None:
    """BlockError(BAD_REQUEST) for a PULL or PULL_MANY whose answer the peer could not take in
    one frame; BlockError(UNSUPPORTED) for a PULL_LOCAL of several ranges that together pass a
    frame (each range that is not a whole block is summed for the answer: a few bytes of
    request naming one block's bytes thousands of times; a reader on route AUTO that groups its
    ranges otherwise, as before 2026-12-07, reads over TCP instead): refused before any block
    is read or summed for it."""
    asked = event.length if isinstance(event, so.Pull) else None
    local = isinstance(event, so.PullLocal) and len(event.items) > 1
    if isinstance(event, so.PullMany) or local:
        asked = sum(n for _, _, n in cast(so.PullMany, event).items)
    limit = session.info.max_frame
    if asked is not None and limit and asked > limit:
        code = ev.ErrorCode.UNSUPPORTED if local else ev.ErrorCode.BAD_REQUEST
        raise BlockError(code, f"asks {asked} bytes: more than the max_frame_size {limit}")


class BlockError(Exception):
    """A refused read: answered ERROR(``code``, message) to that request only."""

    def __init__(self, code: ev.ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class BlockService(Service):
    """Base of every block server (see the module docstring)."""

    vocabulary = so.STORE

    def __init__(self, *, shared: Iterable[SharedRegion] = ()) -> None:
        self._held: dict[Session, set[int]] = {}
        self._held_lock = threading.Lock()
        self._partials = PartialSums()  # a PULL_MANY of whole blocks: its checksum composed from theirs
        self.shared = check_shared(shared)
        """This process's memory that same-host readers may map (``HostArena.shared`` of host
        arenas made ``shareable``); UsageError naming ``shared`` for anything else."""

    # -- what a block server implements -------------------------------------------------------
    def lease(self, req: so.ReadLease) -> so.LeaseReply:
        """Pin every key of ``req`` (GRANTED with sizes) or none (MISSING); BlockError to refuse."""
        raise NotImplementedError

    def view(
        self, lease_id: int, key: bytes, offset: int, length: int
    ) -> tuple[memoryview, tuple[PayloadChecksum, int] | None]:
        """``(bytes, known (algo, checksum) of exactly those bytes or None)``; BlockError to refuse."""
        raise NotImplementedError

    def release(self, lease_id: int) -> bool:
        """Unpin a lease; True when it was still held."""
        raise NotImplementedError

    def holds(self, lease_id: int) -> bool:
        """Whether ``lease_id`` is still held (not released, not past its TTL). A connection at
        MAX_SESSION_LEASES counts only these; this base answers True (every lease counted)."""
        return True

    def views(
        self, lease_id: int, items: Iterable[tuple[bytes, int, int]]
    ) -> list[tuple[memoryview, tuple[PayloadChecksum, int] | None]]:
        """:meth:`view` of each ``(key, offset, length)``, all or BlockError (a server may
        check the lease once for all of them)."""
        return [self.view(lease_id, *item) for item in items]

    def regions(self, lease_id: int, items: Iterable[tuple[bytes, int, int]]) -> np.ndarray:
        """Where each ``(key, offset, length)`` is in this process, for a same-host reader: an
        (n, 3) uint64 array of (address, length, checksum by ``SUPPORTED[0]``), all or
        BlockError as :meth:`views`. This one goes through :meth:`views`; a server that knows
        where its blocks are answers without a view per item."""
        algo = SUPPORTED[0]
        rows = [
            (local.address_of(v), len(v), k[1] if k is not None and k[0] is algo else payload_checksum(algo, v))
            for v, k in self.views(lease_id, items)
        ]
        return np.array(rows, np.uint64).reshape(-1, 3)

    def offer(self, req: so.Offer, session: Session) -> Iterable[object] | Park:
        """Answers to an OFFER; a read-only server refuses every offer."""
        return [so.OfferReply(req.request_id, so.OfferStatus.REFUSED)]

    # -- the wire -------------------------------------------------------------------------------
    def handle(self, session: Session, event: object) -> Iterable[object] | Park:
        if isinstance(event, so.Offer):
            return self.offer(event, session)
        if isinstance(event, ev.Ping):
            return [ev.Pong(event.request_id, event.token)]
        if isinstance(event, so.ReadLease):
            return [self._lease(session, event)]
        if isinstance(event, so.Release):
            return [self._release(session, event)]
        try:
            _fits(session, event)
            if isinstance(event, so.Pull):
                return [ev.Data(event.request_id, *self.view(event.lease_id, event.key, event.offset, event.length))]
            if isinstance(event, so.PullMany):
                found = self.views(event.lease_id, event.items)
                known = self._partials.composed([(item[0], *v) for item, v in zip(event.items, found)])
                return [ev.Data(event.request_id, [view for view, _ in found], known)]
            if isinstance(event, so.PullLocal):
                return [self._local(session, event)]
        except BlockError as exc:
            return [ev.Error(getattr(event, "request_id", 0), exc.code, str(exc))]
        except ChangedBlock as exc:  # never served as anything but what its checksum vouches for
            return [ev.Error(getattr(event, "request_id", 0), ev.ErrorCode.INTERNAL, str(exc))]
        return [ev.Error(getattr(event, "request_id", 0), ev.ErrorCode.UNSUPPORTED, type(event).__name__)]

    def _lease(self, session: Session, req: so.ReadLease) -> so.LeaseReply | ev.Error:
        if self._full(session):
            return ev.Error(req.request_id, ev.ErrorCode.CAPACITY, _TOO_MANY_LEASES)
        try:
            reply = self.lease(req)
        except BlockError as exc:
            return ev.Error(req.request_id, exc.code, str(exc))
        if reply.status is so.LeaseStatus.GRANTED:
            with self._held_lock:
                held = self._held.setdefault(session, set())
                held.add(reply.lease_id)
            if session.closed:  # ended while we granted: nobody will release it
                self.closed(session)
        return reply

    def _full(self, session: Session) -> bool:
        """Whether ``session`` holds MAX_SESSION_LEASES leases (each pins its blocks); at the cap,
        the leases that ended by their TTL are forgotten first."""
        with self._held_lock:
            held = self._held.get(session, set())
            if len(held) < MAX_SESSION_LEASES:
                return False
            ids = list(held)
        ended = {lease_id for lease_id in ids if not self.holds(lease_id)}
        for lease_id in ended:  # the server forgets them too (an expired lease is not yet released)
            self.release(lease_id)
        with self._held_lock:
            held -= ended
            return len(held) >= MAX_SESSION_LEASES

    def _release(self, session: Session, req: so.Release) -> ev.CommitReply:
        with self._held_lock:
            self._held.get(session, set()).discard(req.lease_id)
        if self.release(req.lease_id):
            return ev.CommitReply(req.request_id, ev.CommitStatus.COMMITTED)
        return ev.CommitReply(req.request_id, ev.CommitStatus.FAILED, "lease expired")

    def _local(self, session: Session, req: so.PullLocal) -> ev.LocalReply:
        if not session.info.same_host:
            raise BlockError(ev.ErrorCode.UNSUPPORTED, "PULL_LOCAL from another host")
        if self.private_memory:  # the reader copies with process_vm_readv, which Yama may refuse
            local.allow_readers()
        regions = self.regions(req.lease_id, req.items)
        return ev.LocalReply(req.request_id, os.getpid(), SUPPORTED[0], regions, covering(self.shared, regions))

    @property
    def private_memory(self) -> bool:
        """Whether same-host readers may need ``process_vm_readv`` of this process (then its
        first PULL_LOCAL lets same-uid processes trace it where Yama asks for that): True
        unless every block lies in :attr:`shared` memory, which readers map instead."""
        return True

    def closed(self, session: Session) -> None:
        with self._held_lock:
            leases = self._held.pop(session, set())
        for lease_id in leases:  # each on its own: one that fails does not keep the others pinned
            try:
                self.release(lease_id)
            except Exception:  # logged; its TTL still ends it
                logging.getLogger(__name__).exception("releasing lease %x of a closed session failed", lease_id)

    def session_leases(self) -> int:
        """Leases held by open sessions (tests, metrics)."""
        with self._held_lock:
            return sum(len(v) for v in self._held.values())


class MemoryBlockSource(BlockService):
    """Serves ``blocks`` (16-byte key -> bytes-like). Thread-safe.

    ``clock``: monotonic seconds (injectable so lease expiry can be tested); ``shared``: the
    shareable memory the blocks lie in (``HostArena.shared`` of arenas made ``shareable``).
    """

    def __init__(
        self,
        blocks: Mapping[bytes, object],
        clock: Callable[[], float] = time.monotonic,
        *,
        shared: Iterable[SharedRegion] = (),
    ) -> None:
        super().__init__(shared=shared)
        self._blocks = {bytes(k): memoryview(cast("Buffer", v)).cast("B") for k, v in blocks.items()}
        self._clock = clock
        self._sums: dict[bytes, tuple[PayloadChecksum, int]] = {}
        self._rows: dict[bytes, tuple[int, int, int]] = {}  # key -> a whole block's regions() row
        self._leases: Deadlines[int, frozenset[bytes]] = Deadlines()  # lease id -> keys, at its end
        self._leased = 0  # keys of self._leases
        self._lock = threading.Lock()

    def lease(self, req: so.ReadLease) -> so.LeaseReply:
        """Hold the keys (all or nothing); BlockError(CAPACITY) past MAX_LEASED_KEYS under lease
        (leases past their TTL forgotten first)."""
        missing = tuple(k for k in req.keys if k not in self._blocks)
        if missing:
            return so.LeaseReply(req.request_id, so.LeaseStatus.MISSING, missing=missing)
        ttl, keys = clamp_ttl(req.ttl_s), frozenset(req.keys)
        with self._lock:
            self._forget_ended()
            if self._leased + len(keys) > MAX_LEASED_KEYS:
                raise BlockError(ev.ErrorCode.CAPACITY, f"{self._leased} keys are under lease here")
            lease_id = new_lease_id(self._leases)
            self._leases.set(lease_id, self._clock() + ttl, keys)
            self._leased += len(keys)
        sizes = tuple(len(self._blocks[k]) for k in req.keys)
        return so.LeaseReply(req.request_id, so.LeaseStatus.GRANTED, lease_id, ttl, sizes)

    def _forget_ended(self) -> None:
        """Drop the leases past their end (under the lock)."""
        for _, ended in self._leases.due(self._clock()):
            self._leased -= len(ended)

    def _held_keys(self, lease_id: int) -> frozenset[bytes] | None:
        with self._lock:
            self._forget_ended()
            return self._leases.get(lease_id)

    def view(
        self, lease_id: int, key: bytes, offset: int, length: int
    ) -> tuple[memoryview, tuple[PayloadChecksum, int] | None]:
        return self.views(lease_id, [(key, offset, length)])[0]

    def views(
        self, lease_id: int, items: Iterable[tuple[bytes, int, int]]
    ) -> list[tuple[memoryview, tuple[PayloadChecksum, int] | None]]:
        keys = self._held_keys(lease_id)  # once for all the items
        if keys is None:
            raise BlockError(ev.ErrorCode.LEASE_EXPIRED, "lease not held")
        return [self._range(keys, *item) for item in items]

    def _range(
        self, keys: frozenset[bytes], key: bytes, offset: int, length: int
    ) -> tuple[memoryview, tuple[PayloadChecksum, int] | None]:
        if key not in keys:
            raise BlockError(ev.ErrorCode.NOT_FOUND, "key not under this lease")
        block = self._blocks[key]
        if offset + length > len(block):
            raise BlockError(ev.ErrorCode.BAD_REQUEST, "range beyond the block")
        if offset == 0 and length == len(block):
            return block, self._sum(key, block)
        return block[offset : offset + length], None

    def _sum(self, key: bytes, block: memoryview) -> tuple[PayloadChecksum, int]:
        """The block's payload checksum (this build's preferred algorithm), computed once: blocks
        must not change while served (a changed one is refused by the receiver, never passed)."""
        known = self._sums.get(key)
        if known is None:
            known = self._sums[key] = (SUPPORTED[0], payload_checksum(SUPPORTED[0], block))
            self._rows[key] = (local.address_of(block), len(block), known[1])
        return known

    def regions(self, lease_id: int, items: Iterable[tuple[bytes, int, int]]) -> np.ndarray:
        """Whole blocks held by the lease from the rows kept with their checksums (a dict
        lookup each); anything else as the base answers it."""
        items = tuple(items)
        keys, rows = self._held_keys(lease_id), self._rows
        if keys is not None:
            found = [rows.get(k) if o == 0 and k in keys else None for k, o, _ in items]
            if all(r is not None and r[1] == n for r, (_, _, n) in zip(found, items)):
                return np.array(found, np.uint64).reshape(-1, 3)
        return super().regions(lease_id, items)

    def holds(self, lease_id: int) -> bool:
        return self._held_keys(lease_id) is not None

    def release(self, lease_id: int) -> bool:
        held = self._held_keys(lease_id) is not None
        with self._lock:
            self._leased -= len(self._leases.pop(lease_id) or ())
        return held

    @property
    def active_leases(self) -> int:
        with self._lock:
            return len(self._leases)
