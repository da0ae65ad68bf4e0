"""A block source served over a transport: leases and pulls over an in-memory dict.

Implements the reader side of "the destination pulls": READ_LEASE validates and
pins all keys (all-or-nothing; TTL clamped to [30, 600] s, default 120), PULL
returns a zero-copy view of the requested range, RELEASE answers COMMITTED only
when the lease was still held. OFFER is REFUSED (this source stores nothing).
"""
from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Mapping

from tiersync.errors import UsageError
from tiersync.net import events as ev
from tiersync.net.frames import SUPPORTED, PayloadChecksum, payload_checksum

LEASE_TTL_MIN_S, LEASE_TTL_MAX_S = 30, 600


def dispatch(handler: object, event: object) -> list:
    """Route one request to ``handler``'s ``_lease``/``_pull``/``_release``/``offer``; answer PING.

    Shared by every block-serving handler. Raises UsageError for a non-request event.
    """
    if isinstance(event, ev.Ping):
        return [ev.Pong(event.request_id, event.token)]
    if isinstance(event, ev.ReadLease):
        return [handler._lease(event)]
    if isinstance(event, ev.Pull):
        return [handler._pull(event)]
    if isinstance(event, ev.Release):
        return [handler._release(event)]
    if isinstance(event, ev.Offer):
        return list(handler.offer(event))
    raise UsageError("not a request", argument="event")


class MemoryBlockSource:
    """Callable handler over ``blocks`` (16-byte key -> bytes-like). Thread-safe.

    ``clock``: monotonic seconds (injectable so lease expiry can be tested).
    """

    def __init__(self, blocks: Mapping[bytes, bytes], clock: Callable[[], float] = time.monotonic) -> None:
        self._blocks = {bytes(k): memoryview(v).cast("B") for k, v in blocks.items()}
        self._clock = clock
        self._sums: dict[bytes, tuple[PayloadChecksum, int]] = {}
        self._leases: dict[int, tuple[float, frozenset[bytes]]] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def __call__(self, event: object) -> list:
        return dispatch(self, event)

    def offer(self, req: ev.Offer) -> list:
        """A read-only source refuses every offer."""
        return [ev.OfferReply(req.request_id, ev.OfferStatus.REFUSED)]

    def _lease(self, req: ev.ReadLease) -> ev.LeaseReply:
        missing = tuple(k for k in req.keys if k not in self._blocks)
        if missing:
            return ev.LeaseReply(req.request_id, ev.LeaseStatus.MISSING, missing=missing)
        ttl = min(max(req.ttl_s, LEASE_TTL_MIN_S), LEASE_TTL_MAX_S)
        with self._lock:
            lease_id = next(self._ids)
            self._leases[lease_id] = (self._clock() + ttl, frozenset(req.keys))
        sizes = tuple(len(self._blocks[k]) for k in req.keys)
        return ev.LeaseReply(req.request_id, ev.LeaseStatus.GRANTED, lease_id, ttl, sizes)

    def _held(self, lease_id: int) -> frozenset[bytes] | None:
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease[0] <= self._clock():
                return None
            return lease[1]

    def _pull(self, req: ev.Pull) -> object:
        keys = self._held(req.lease_id)
        if keys is None:
            return ev.Error(req.request_id, ev.ErrorCode.LEASE_EXPIRED, "lease not held")
        if req.key not in keys:
            return ev.Error(req.request_id, ev.ErrorCode.NOT_FOUND, "key not under this lease")
        block = self._blocks[req.key]
        if req.offset + req.length > len(block):
            return ev.Error(req.request_id, ev.ErrorCode.BAD_REQUEST, "range beyond the block")
        if req.offset == 0 and req.length == len(block):
            return ev.Data(req.request_id, block, self._sum(req.key, block))
        return ev.Data(req.request_id, block[req.offset:req.offset + req.length])

    def _sum(self, key: bytes, block: memoryview) -> tuple[PayloadChecksum, int]:
        """The block's payload checksum (this build's preferred algorithm), computed once: blocks
        must not change while served (a changed one is refused by the receiver, never passed)."""
        known = self._sums.get(key)
        if known is None:
            known = self._sums[key] = (SUPPORTED[0], payload_checksum(SUPPORTED[0], block))
        return known

    def _release(self, req: ev.Release) -> ev.CommitReply:
        held = self._held(req.lease_id) is not None
        with self._lock:
            self._leases.pop(req.lease_id, None)
        status = ev.CommitStatus.COMMITTED if held else ev.CommitStatus.FAILED
        return ev.CommitReply(req.request_id, status, "" if held else "lease expired")

    @property
    def active_leases(self) -> int:
        with self._lock:
            return len(self._leases)
