"""The block store's operations (offers, read leases, pulls, releases) on the one tiersync frame
format: what store nodes, offer sources and :class:`~tiersync.net.source.MemoryBlockSource`
speak (:data:`STORE`), beside the core vocabulary of :mod:`tiersync.net.events` (handshake,
ERROR, PING, DATA, and the responses other services share: LOCAL_REPLY, COMMIT_REPLY), as
:mod:`tiersync.disagg.ops` and :mod:`tiersync.weights.ops` define theirs. Constructing an event
with bad fields raises :class:`UsageError`; parsing bad metadata from a peer raises
:class:`~tiersync.net.errors.ProtocolError` (MALFORMED). Enum fields travel as u8; their values
are wire format — never renumber.
"""

from __future__ import annotations

import itertools
import operator
import struct
from dataclasses import dataclass
from typing import ClassVar

from tiersync.errors import UsageError
from tiersync.net.codec import KEY_SIZE, MetaReader, MetaWriter
from tiersync.net.errors import ProtocolError, ProtocolFault
from tiersync.net.events import CORE, CommitReply, Data, LocalReply
from tiersync.net.fields import (
    CommitStatus,
    LeaseStatus,
    OfferStatus,
    check_bytes,
    check_enum,
    check_keys,
    check_rows,
    check_text,
    check_u64,
    check_u64s,
    parsed,
)
from tiersync.net.frames import Op, ProtocolConfig
from tiersync.net.vocab import Vocabulary

__all__ = [
    "STORE",
    "CommitStatus",
    "LeaseReply",
    "LeaseStatus",
    "Offer",
    "OfferReply",
    "OfferStatus",
    "Pull",
    "PullLocal",
    "PullMany",
    "ReadLease",
    "Release",
]

_PULL_META = struct.Struct(f"<QI{KEY_SIZE}sQQ")  # lease id, key length, key, offset, length
_ITEM = struct.Struct(f"<{KEY_SIZE}sQQ")  # one PULL_MANY / PULL_LOCAL item: key, offset, length
_KEY_OF = operator.itemgetter(0)


@dataclass(frozen=True, slots=True)
class Offer:
    """Writer -> destination: blocks ``keys`` (sizes in bytes) pullable under ``lease_id``.

    ``source``: the writer's "host:port" to pull from. A store node dials only the IP it sees
    the writer's connection come from: an empty host (":port") means that IP, any other host
    must be it.
    """

    OP: ClassVar[Op] = Op.OFFER
    request_id: int
    lease_id: int
    keys: tuple[bytes, ...]
    sizes: tuple[int, ...]
    source: str = ""

    def __post_init__(self) -> None:
        check_u64("request_id", self.request_id)
        check_u64("lease_id", self.lease_id)
        check_keys("keys", self.keys)
        check_u64s("sizes", self.sizes)
        check_text("source", self.source)
        if len(self.sizes) != len(self.keys):
            raise UsageError("must have one size per key", argument="sizes")

    def meta(self) -> bytes:
        return MetaWriter().u64(self.lease_id).keys(self.keys).u64s(self.sizes).text(self.source).getvalue()

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> Offer:
        return cls(rid, r.u64(), r.keys(cfg.max_keys), r.u64s(cfg.max_keys), r.text(cfg.max_string))


@dataclass(frozen=True, slots=True)
class OfferReply:
    """``existing``: keys the destination already holds (the overlap)."""

    OP: ClassVar[Op] = Op.OFFER_REPLY
    request_id: int
    status: OfferStatus
    existing: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        check_u64("request_id", self.request_id)
        check_enum("status", self.status, OfferStatus)
        check_keys("existing", self.existing)

    def meta(self) -> bytes:
        return MetaWriter().u8(self.status).keys(self.existing).getvalue()

    def then(self) -> frozenset[int] | None:
        """ACCEPT / PARTIAL_EXIST are followed by a COMMIT_REPLY."""
        if self.status in (OfferStatus.ACCEPT, OfferStatus.PARTIAL_EXIST):
            return frozenset({int(Op.COMMIT_REPLY)})
        return None

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> OfferReply:
        return cls(rid, OfferStatus(r.u8()), r.keys(cfg.max_keys))


@dataclass(frozen=True, slots=True)
class ReadLease:
    """Reader -> source: validate and pin all ``keys`` for ``ttl_s`` seconds (all-or-nothing)."""

    OP: ClassVar[Op] = Op.READ_LEASE
    request_id: int
    keys: tuple[bytes, ...]
    ttl_s: int = 120

    def __post_init__(self) -> None:
        check_u64("request_id", self.request_id)
        check_keys("keys", self.keys)
        check_u64("ttl_s", self.ttl_s)

    def meta(self) -> bytes:
        return MetaWriter().keys(self.keys).u64(self.ttl_s).getvalue()

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> ReadLease:
        return cls(rid, r.keys(cfg.max_keys), r.u64())


@dataclass(frozen=True, slots=True)
class LeaseReply:
    """GRANTED: ``lease_id``, clamped ``ttl_s``, one size per key. MISSING: ``missing`` keys."""

    OP: ClassVar[Op] = Op.LEASE_REPLY
    request_id: int
    status: LeaseStatus
    lease_id: int = 0
    ttl_s: int = 0
    sizes: tuple[int, ...] = ()
    missing: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        check_u64("request_id", self.request_id)
        check_enum("status", self.status, LeaseStatus)
        check_u64("lease_id", self.lease_id)
        check_u64("ttl_s", self.ttl_s)
        check_u64s("sizes", self.sizes)
        check_keys("missing", self.missing)

    def meta(self) -> bytes:
        w = MetaWriter().u8(self.status).u64(self.lease_id).u64(self.ttl_s)
        return w.u64s(self.sizes).keys(self.missing).getvalue()

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> LeaseReply:
        return cls(rid, LeaseStatus(r.u8()), r.u64(), r.u64(), r.u64s(cfg.max_keys), r.keys(cfg.max_keys))


@dataclass(frozen=True, slots=True)
class Pull:
    """Ask for ``length`` bytes of block ``key`` from ``offset`` under ``lease_id``."""

    OP: ClassVar[Op] = Op.PULL
    request_id: int
    lease_id: int
    key: bytes
    offset: int
    length: int

    def __post_init__(self) -> None:
        for name in ("request_id", "lease_id", "offset", "length"):
            check_u64(name, getattr(self, name))
        check_bytes("key", self.key, (KEY_SIZE,))

    def meta(self) -> bytes:
        w = MetaWriter().u64(self.lease_id).blob(self.key)
        return w.u64(self.offset).u64(self.length).getvalue()

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> Pull:
        fixed = r.peek_exact(_PULL_META)
        if fixed is not None and fixed[1] == KEY_SIZE:  # the usual layout: one unpack
            r.skip(_PULL_META.size)
            return parsed(cls, rid, fixed[0], fixed[2], fixed[3], fixed[4])  # the format bounds each field
        return cls(rid, r.u64(), r.blob(KEY_SIZE), r.u64(), r.u64())


def _check_items(name: str, items: object) -> None:
    if not isinstance(items, tuple) or not items:
        raise UsageError("must be a non-empty tuple of (key, offset, length)", argument=name)
    check_rows(name, items, (bytes, int, int))
    if set(map(len, map(_KEY_OF, items))) - {KEY_SIZE}:
        raise UsageError(f"keys must be {KEY_SIZE} bytes", argument=name)


def _write_items(w: MetaWriter, items: tuple[tuple[bytes, int, int], ...]) -> MetaWriter:
    w.u32(len(items))
    w.raw(b"".join(itertools.starmap(_ITEM.pack, items)))
    return w


def _read_items(r: MetaReader, cfg: ProtocolConfig) -> tuple[tuple[bytes, int, int], ...]:
    n = r.u32()
    if not 0 < n <= cfg.max_keys:
        raise ProtocolError("item count out of range", fault=ProtocolFault.MALFORMED, count=n, max=cfg.max_keys)
    raw = r.take(n * _ITEM.size)
    return tuple(_ITEM.iter_unpack(raw))


@dataclass(frozen=True, slots=True)
class PullMany:
    """Ask for several ranges ``items`` = ((key, offset, length), ...) under ``lease_id``; the
    answer is one DATA whose payload is the ranges concatenated in order (a receiver may
    scatter it straight into one buffer per item)."""

    OP: ClassVar[Op] = Op.PULL_MANY
    request_id: int
    lease_id: int
    items: tuple[tuple[bytes, int, int], ...]

    def __post_init__(self) -> None:
        check_u64("request_id", self.request_id)
        check_u64("lease_id", self.lease_id)
        _check_items("items", self.items)

    def meta(self) -> bytes:
        return _write_items(MetaWriter().u64(self.lease_id), self.items).getvalue()

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> PullMany:
        return parsed(cls, rid, r.u64(), _read_items(r, cfg))  # items: _ITEM's format bounds them


@dataclass(frozen=True, slots=True)
class PullLocal:
    """Same-host PULL_MANY: instead of the bytes, the source answers LOCAL_REPLY with where they
    are in its memory, for the reader to copy with ``process_vm_readv``. Only sent when the
    handshake showed both ends on one host (:attr:`Ready.host`)."""

    OP: ClassVar[Op] = Op.PULL_LOCAL
    request_id: int
    lease_id: int
    items: tuple[tuple[bytes, int, int], ...]

    def __post_init__(self) -> None:
        check_u64("request_id", self.request_id)
        check_u64("lease_id", self.lease_id)
        _check_items("items", self.items)

    meta = PullMany.meta

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> PullLocal:
        return parsed(cls, rid, r.u64(), _read_items(r, cfg))


@dataclass(frozen=True, slots=True)
class Release:
    """Reader -> source: done with ``lease_id``; the answer says whether it was still held."""

    OP: ClassVar[Op] = Op.RELEASE
    request_id: int
    lease_id: int

    def __post_init__(self) -> None:
        check_u64("request_id", self.request_id)
        check_u64("lease_id", self.lease_id)

    def meta(self) -> bytes:
        return MetaWriter().u64(self.lease_id).getvalue()

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> Release:
        return cls(rid, r.u64())


STORE = Vocabulary(
    "store",
    {
        Offer: (OfferReply,),
        ReadLease: (LeaseReply,),
        Pull: (Data,),
        PullMany: (Data,),
        PullLocal: (LocalReply,),
        Release: (CommitReply,),
    },
    responses=(CommitReply,),
    include=(CORE,),
)
"""Block servers: store nodes, sources of offers, :class:`~tiersync.net.source.MemoryBlockSource`."""
