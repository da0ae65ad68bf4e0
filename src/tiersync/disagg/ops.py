"""The prefill -> decode operations, on the one tiersync frame format (:mod:`tiersync.net`).

A decode rank (client) opens a request on a prefill rank's :class:`~tiersync.disagg.producer.
KVProducer` (server), pulls each layer's route bytes, and says it is done::

    KV_OPEN{read}                        -> KV_OPENED{route_bytes, route_digest}  (the reader joined)
    per layer:
      KV_NEXT{n}                         -> KV_LAYER{layer}  (the n-th layer to become ready;
                                                              waits until it is)
      KV_PULL{n, offset, length} x k     -> DATA (that part of the n-th ready layer's route
                                                  bytes; may be sent before KV_LAYER n arrived)
      or, same host, KV_PULL_LOCAL{...}  -> LOCAL_REPLY (where those bytes are, checksummed)
    KV_DONE                              -> COMMIT_REPLY (COMMITTED: the producer counted it)

A decode engine's scheduler that will not read a request (aborted before its read began, or
computing the prompt itself), or a decode rank whose read of it failed before it was done with
every prefill rank, says so, on a connection of its own::

    KV_DROP{kv_request}                  -> COMMIT_REPLY (COMMITTED: it was pending and is
                                                          failed now: its blocks are freed)

One request at a time per connection; a connection serves many requests one after the
other (the consumer pools them). ``read`` is the JSON of a
:class:`~tiersync.disagg.messages.ReadRequest`, bounded and validated on receipt.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

from tiersync.disagg.messages import MAX_REQUEST_ID, ReadRequest, check_request_id, parse_read
from tiersync.errors import UsageError
from tiersync.net import events as ev
from tiersync.net.codec import MetaReader, MetaWriter
from tiersync.net.errors import ProtocolError, ProtocolFault
from tiersync.net.fields import check_u32, check_u64
from tiersync.net.frames import ProtocolConfig
from tiersync.net.vocab import Vocabulary

__all__ = ["KV", "KvDone", "KvDrop", "KvLayer", "KvNext", "KvOp", "KvOpen", "KvOpened", "KvPull", "KvPullLocal"]


class KvOp(enum.IntEnum):
    """Op codes of prefill -> decode (32-47). Wire format: never renumber."""

    KV_OPEN = 32
    KV_OPENED = 33
    KV_NEXT = 34
    KV_LAYER = 35
    KV_PULL = 36
    KV_PULL_LOCAL = 37
    KV_DONE = 38
    KV_DROP = 39


@dataclass(frozen=True, slots=True)
class KvOpen:
    """Join request ``read.request_id`` as reader ``read.dst_rank`` (see :class:`ReadRequest`)."""

    OP: ClassVar[KvOp] = KvOp.KV_OPEN
    request_id: int
    read: ReadRequest

    def __post_init__(self) -> None:
        check_u64("request_id", self.request_id)
        if not isinstance(self.read, ReadRequest):
            raise UsageError("must be a ReadRequest", argument="read")

    def meta(self) -> bytes:
        return MetaWriter().json(self.read.to_meta()).getvalue()

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> KvOpen:
        return cls(rid, parse_read(r.json(cfg.max_meta_size)))


@dataclass(frozen=True, slots=True)
class KvOpened:
    """The reader joined; each layer's route is ``route_bytes`` long, its span rows digested to
    ``route_digest`` (:func:`~tiersync.disagg.reshard.route_digest`: both sides planned it, and
    the reader checks that they planned the same)."""

    OP: ClassVar[KvOp] = KvOp.KV_OPENED
    request_id: int
    route_bytes: int
    route_digest: int

    def __post_init__(self) -> None:
        for name in ("request_id", "route_bytes", "route_digest"):
            check_u64(name, getattr(self, name))

    def meta(self) -> bytes:
        return MetaWriter().u64(self.route_bytes).u64(self.route_digest).getvalue()

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> KvOpened:
        return cls(rid, r.u64(), r.u64())


@dataclass(frozen=True, slots=True)
class KvNext:
    """Which layer became ready ``n``-th (0-based, asked in order); answered once it is."""

    OP: ClassVar[KvOp] = KvOp.KV_NEXT
    request_id: int
    n: int

    def __post_init__(self) -> None:
        check_u64("request_id", self.request_id)
        check_u32("n", self.n)

    def meta(self) -> bytes:
        return MetaWriter().u32(self.n).getvalue()

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> KvNext:
        return cls(rid, r.u32())


@dataclass(frozen=True, slots=True)
class KvLayer:
    """Answer to KV_NEXT: ``layer`` is on the producer's host, ready to pull."""

    OP: ClassVar[KvOp] = KvOp.KV_LAYER
    request_id: int
    layer: int

    def __post_init__(self) -> None:
        check_u64("request_id", self.request_id)
        check_u32("layer", self.layer)

    def meta(self) -> bytes:
        return MetaWriter().u32(self.layer).getvalue()

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> KvLayer:
        return cls(rid, r.u32())


def _check_pull(pull: KvPull | KvPullLocal) -> None:
    """The field checks of KV_PULL and KV_PULL_LOCAL."""
    for name in ("request_id", "offset", "length"):
        check_u64(name, getattr(pull, name))
    check_u32("n", pull.n)


@dataclass(frozen=True, slots=True)
class KvPull:
    """``length`` bytes at ``offset`` of the route of the ``n``-th ready layer (the one KV_NEXT
    ``n`` names; answer: DATA). Naming it by position lets a reader pipeline the pulls of the
    next layer behind its KV_NEXT, before it knows which layer that is."""

    OP: ClassVar[KvOp] = KvOp.KV_PULL
    request_id: int
    n: int
    offset: int
    length: int

    def __post_init__(self) -> None:
        _check_pull(self)

    def meta(self) -> bytes:
        return MetaWriter().u32(self.n).u64(self.offset).u64(self.length).getvalue()

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> KvPull:
        n, offset, length = r.u32(), r.u64(), r.u64()
        if not 0 < length <= cfg.max_frame_size:
            raise ProtocolError("pull length out of range", fault=ProtocolFault.MALFORMED, length=length)
        return cls(rid, n, offset, length)


@dataclass(frozen=True, slots=True)
class KvPullLocal:
    """Same-host KV_PULL: the answer is a LOCAL_REPLY naming where the bytes are."""

    OP: ClassVar[KvOp] = KvOp.KV_PULL_LOCAL
    request_id: int
    n: int
    offset: int
    length: int

    def __post_init__(self) -> None:
        _check_pull(self)

    meta = KvPull.meta

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> KvPullLocal:
        pull = KvPull.parse(rid, r, cfg)
        return cls(rid, pull.n, pull.offset, pull.length)


@dataclass(frozen=True, slots=True)
class KvDone:
    """The reader landed every layer (answer: COMMIT_REPLY)."""

    OP: ClassVar[KvOp] = KvOp.KV_DONE
    request_id: int

    def __post_init__(self) -> None:
        check_u64("request_id", self.request_id)

    def meta(self) -> bytes:
        return b""

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> KvDone:
        return cls(rid)


@dataclass(frozen=True, slots=True)
class KvDrop:
    """No decode rank will read request ``kv_request``: stop serving it (answer: COMMIT_REPLY)."""

    OP: ClassVar[KvOp] = KvOp.KV_DROP
    request_id: int
    kv_request: str

    def __post_init__(self) -> None:
        check_u64("request_id", self.request_id)
        check_request_id(self.kv_request, "kv_request")
        try:
            self.kv_request.encode("utf-8")
        except UnicodeEncodeError:
            raise UsageError("must be encodable as UTF-8", argument="kv_request") from None

    def meta(self) -> bytes:
        return MetaWriter().text(self.kv_request).getvalue()

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> KvDrop:
        try:
            return cls(rid, r.text(4 * MAX_REQUEST_ID))
        except UsageError as exc:
            raise ProtocolError(f"bad KV_DROP: {exc}", fault=ProtocolFault.MALFORMED) from None


KV = Vocabulary(
    "kv",
    {
        KvOpen: (KvOpened,),
        KvNext: (KvLayer,),
        KvPull: (ev.Data,),
        KvPullLocal: (ev.LocalReply,),
        KvDone: (ev.CommitReply,),
        KvDrop: (ev.CommitReply,),
    },
    include=(ev.CORE,),
)
"""What prefill -> decode connections speak."""
