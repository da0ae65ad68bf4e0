"""The weight-sync operations, on the one tiersync frame format (:mod:`tiersync.net`).

A sampler opens a control connection to every trainer shard (:class:`~tiersync.weights.
publisher.WeightPublisher`) and registers; the shard then pushes each version to it::

    W_REGISTER{label, rank, host, transport, relay, zero_copy} -> W_WELCOME{transport, source_rank, inc}
                                                                  (or ERROR: refused)
    <- W_ANNOUNCE{manifest}     one-way: version v is being written (JSON, bounded)
    <- W_READY{v, count}        one-way: the first ``count`` tensors of v are complete (to
                                samplers on shared memory; a GET waits for its tensor itself)
    W_ACK{v, ok, seconds, error, moved} ->   one-way: this sampler's outcome of v
    W_RELEASE{v} ->             one-way, zero-copy samplers: no longer reading v's segment

Data connections (to a trainer shard, or to a relaying sampler) only ask for spans::

    W_GET{v, inc, tensor, key, span} -> DATA (the span's bytes in C order) or ERROR
    W_SUMS{v, inc, tensor, spans} -> W_SUMS_REPLY{algo, sums}   (trainer shards only: the
                                payload checksum of each span of v; what delta syncs compare)

``inc``: the incarnation of the trainer shard whose manifest the sampler read; a trainer shard
restarted on the same address (another incarnation, version numbers reused with other bytes)
refuses it.

Every frame is checksummed and bounded by the stack (token, TLS and deadlines:
``PublisherConfig.tcp_config`` / ``ReceiverConfig.tcp_config``); each field is validated on
parse (ProtocolError MALFORMED otherwise).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

from tiersync.errors import UsageError
from tiersync.net import events as ev
from tiersync.net.codec import MetaReader, MetaWriter
from tiersync.net.config import parse_address
from tiersync.net.fields import check_text, check_u64, check_u64s
from tiersync.net.frames import ProtocolConfig
from tiersync.net.vocab import Vocabulary
from tiersync.weights.config import MAX_SPAN_BYTES, TransportKind
from tiersync.weights.manifest import Manifest
from tiersync.weights.spans import StridedSpan

__all__ = [
    "WEIGHTS",
    "Ack",
    "Announce",
    "Get",
    "Ready",
    "Register",
    "Release",
    "Sums",
    "SumsReply",
    "WeightsOp",
    "Welcome",
]

_MAX_DIMS = 32
_MAX_SPANS = 1 << 16  # spans of one W_SUMS (one tensor's chunks from one trainer shard)


class WeightsOp(enum.IntEnum):
    """Op codes of weight sync (48-63). Wire format: never renumber."""

    W_REGISTER = 48
    W_WELCOME = 49
    W_ANNOUNCE = 50
    W_READY = 51
    W_ACK = 52
    W_RELEASE = 53
    W_GET = 54
    W_SUMS = 55
    W_SUMS_REPLY = 56


def _flag(r: MetaReader) -> bool:
    value = r.u8()
    if value > 1:
        raise ValueError("a flag must be 0 or 1")
    return bool(value)


@dataclass(frozen=True, slots=True)
class Register:
    """Sampler -> trainer shard: register ``label`` as destination rank ``rank`` (host ``host``:
    :func:`~tiersync.weights.manifest.host_id`), asking for ``transport``; ``relay``: where it
    serves relays ("" for none); ``zero_copy``: it will serve out of the shard's segment."""

    OP: ClassVar[WeightsOp] = WeightsOp.W_REGISTER
    request_id: int
    label: str
    rank: int
    host: str
    transport: TransportKind
    relay: str = ""
    zero_copy: bool = False

    def __post_init__(self) -> None:
        check_u64("request_id", self.request_id)
        check_u64("rank", self.rank)
        for name in ("label", "host", "relay"):
            check_text(name, getattr(self, name))
        if not isinstance(self.transport, TransportKind) or not isinstance(self.zero_copy, bool):
            raise UsageError("must be a TransportKind and a bool", argument="transport")
        if not 0 < len(self.label) <= _MAX_RELAY or not self.label.isprintable():  # a log's and a map's key
            raise UsageError(f"must be 1 to {_MAX_RELAY} printable characters", argument="label")
        if self.relay:  # every sampler's manifest lists it: a short ASCII host:port
            if len(self.relay) > _MAX_RELAY or not (self.relay.isascii() and self.relay.isprintable()):
                raise UsageError(f"must be '' or an ASCII 'host:port' of at most {_MAX_RELAY} bytes", argument="relay")
            if parse_address(self.relay, "relay")[1] == 0:
                raise UsageError("must name a port, not 0", argument="relay")

    def meta(self) -> bytes:
        w = MetaWriter().text(self.label).u64(self.rank).text(self.host).text(self.transport.value)
        return w.text(self.relay).u8(self.zero_copy).getvalue()

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> Register:
        n = cfg.max_string
        return cls(rid, r.text(n), r.u64(), r.text(n), TransportKind(r.text(n)), r.text(n), _flag(r))


@dataclass(frozen=True, slots=True)
class Welcome:
    """Answer to W_REGISTER: accepted as source rank ``source_rank``, bytes via ``transport``,
    by the trainer process ``incarnation`` (what its manifests name)."""

    OP: ClassVar[WeightsOp] = WeightsOp.W_WELCOME
    request_id: int
    transport: TransportKind
    source_rank: int
    incarnation: int = 0

    def __post_init__(self) -> None:
        for name in ("request_id", "source_rank", "incarnation"):
            check_u64(name, getattr(self, name))
        if self.transport not in (TransportKind.SHM, TransportKind.TCP):
            raise UsageError("must be SHM or TCP", argument="transport", value=self.transport)

    def meta(self) -> bytes:
        return MetaWriter().text(self.transport.value).u64(self.source_rank).u64(self.incarnation).getvalue()

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> Welcome:
        return cls(rid, TransportKind(r.text(cfg.max_string)), r.u64(), r.u64())


@dataclass(frozen=True, slots=True)
class Announce:
    """Trainer shard -> sampler: version ``manifest.version`` is being written."""

    OP: ClassVar[WeightsOp] = WeightsOp.W_ANNOUNCE
    manifest: Manifest

    def __post_init__(self) -> None:
        if not isinstance(self.manifest, Manifest):
            raise UsageError("must be a Manifest", argument="manifest")

    def meta(self) -> bytes:
        return MetaWriter().json(self.manifest.to_json()).getvalue()

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> Announce:
        return cls(Manifest.from_json(r.json(cfg.max_meta_size)))


@dataclass(frozen=True, slots=True)
class Ready:
    """Trainer shard -> sampler: the first ``count`` tensors of ``version`` are complete."""

    OP: ClassVar[WeightsOp] = WeightsOp.W_READY
    version: int
    count: int

    def __post_init__(self) -> None:
        check_u64("version", self.version)
        check_u64("count", self.count)

    def meta(self) -> bytes:
        return MetaWriter().u64(self.version).u64(self.count).getvalue()

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> Ready:
        return cls(r.u64(), r.u64())


@dataclass(frozen=True, slots=True)
class Ack:
    """Sampler -> trainer shard: its outcome of ``version`` (``error`` empty when ``ok``)."""

    OP: ClassVar[WeightsOp] = WeightsOp.W_ACK
    version: int
    ok: bool
    seconds: float = 0.0
    error: str = ""
    moved: int = 0  # bytes this sampler fetched for the version (shm, tcp, relay)

    def __post_init__(self) -> None:
        check_u64("version", self.version)
        check_u64("moved", self.moved)
        check_text("error", self.error)
        if (
            not isinstance(self.ok, bool)
            or isinstance(self.seconds, bool)
            or not isinstance(self.seconds, (int, float))
            or not self.seconds >= 0
        ):
            raise UsageError("ok must be a bool and seconds a number >= 0", argument="seconds")

    def meta(self) -> bytes:
        w = MetaWriter().u64(self.version).u8(self.ok).f64(float(self.seconds)).text(self.error)
        return w.u64(self.moved).getvalue()

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> Ack:
        return cls(r.u64(), _flag(r), r.f64(), r.text(cfg.max_string), r.u64())


@dataclass(frozen=True, slots=True)
class Release:
    """Zero-copy sampler -> trainer shard: it no longer reads ``version``'s segment."""

    OP: ClassVar[WeightsOp] = WeightsOp.W_RELEASE
    version: int

    def __post_init__(self) -> None:
        check_u64("version", self.version)

    def meta(self) -> bytes:
        return MetaWriter().u64(self.version).getvalue()

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> Release:
        return cls(r.u64())


@dataclass(frozen=True, slots=True)
class Get:
    """The bytes of ``span`` (of this holder's local shard of ``tensor``, version ``version``)
    in C order; ``key``: the chunk's global box start (what a relay looks it up by);
    ``incarnation``: the trainer shard's, from the manifest the sampler read (a trainer shard
    refuses another one's; a relay ignores it)."""

    OP: ClassVar[WeightsOp] = WeightsOp.W_GET
    request_id: int
    version: int
    tensor: str
    key: tuple[int, ...]
    span: StridedSpan
    incarnation: int = 0

    def __post_init__(self) -> None:
        for name in ("request_id", "version", "incarnation"):
            check_u64(name, getattr(self, name))
        check_text("tensor", self.tensor)
        check_u64s("key", self.key)
        if len(self.key) > _MAX_DIMS:
            raise UsageError(f"must have at most {_MAX_DIMS} dimensions", argument="key")
        _check_span(self.span)

    def meta(self) -> bytes:
        w = MetaWriter().u64(self.version).u64(self.incarnation).text(self.tensor).u64s(self.key)
        return _write_span(w, self.span).getvalue()

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> Get:
        version, incarnation, tensor, key = r.u64(), r.u64(), r.text(cfg.max_string), r.u64s(_MAX_DIMS)
        return cls(rid, version, tensor, key, _read_span(r), incarnation)


_MAX_RELAY = 255


def _check_span(s: object) -> None:
    if not isinstance(s, StridedSpan) or len(s.counts) > _MAX_DIMS or len(s.counts) != len(s.strides):
        raise UsageError(f"must be a StridedSpan of at most {_MAX_DIMS} dimensions", argument="span")
    check_u64s("span", (s.offset, *s.counts, *s.strides))
    if any(v >= 1 << 63 for v in (s.offset, *s.strides)):  # numpy addresses bytes with int64
        raise UsageError("offset and strides must be below 2**63", argument="span")
    if s.row_bytes <= 0 or any(c <= 0 for c in s.counts) or s.nbytes > MAX_SPAN_BYTES:
        raise UsageError(f"must hold 1..{MAX_SPAN_BYTES} bytes", argument="span")
    if not s.disjoint:  # rows sharing bytes (a stride of 0): a few bytes of a tensor asked 2**26 times
        raise UsageError("rows must not overlap", argument="span")


def _write_span(w: MetaWriter, s: StridedSpan) -> MetaWriter:
    return w.u64(s.offset).u64(s.row_bytes).u64s(s.counts).u64s(s.strides)


def _read_span(r: MetaReader) -> StridedSpan:
    return StridedSpan(r.u64(), r.u64(), r.u64s(_MAX_DIMS), r.u64s(_MAX_DIMS))


@dataclass(frozen=True, slots=True)
class Sums:
    """Sampler -> trainer shard: the payload checksums of ``spans`` of its local shard of
    ``tensor``, version ``version`` (answered once that tensor is written); ``incarnation`` as
    in :class:`Get`."""

    OP: ClassVar[WeightsOp] = WeightsOp.W_SUMS
    request_id: int
    version: int
    tensor: str
    spans: tuple[StridedSpan, ...]
    incarnation: int = 0

    def __post_init__(self) -> None:
        for name in ("request_id", "version", "incarnation"):
            check_u64(name, getattr(self, name))
        check_text("tensor", self.tensor)
        if not isinstance(self.spans, tuple) or not 0 < len(self.spans) <= _MAX_SPANS:
            raise UsageError(f"must be a tuple of 1..{_MAX_SPANS} spans", argument="spans")
        for s in self.spans:
            _check_span(s)

    def meta(self) -> bytes:
        w = MetaWriter().u64(self.version).u64(self.incarnation).text(self.tensor).u32(len(self.spans))
        for s in self.spans:
            _write_span(w, s)
        return w.getvalue()

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> Sums:
        version, incarnation, tensor, n = r.u64(), r.u64(), r.text(cfg.max_string), r.u32()
        if not 0 < n <= _MAX_SPANS:
            raise ValueError(f"a W_SUMS names 1..{_MAX_SPANS} spans, not {n}")
        return cls(rid, version, tensor, tuple(_read_span(r) for _ in range(n)), incarnation)


@dataclass(frozen=True, slots=True)
class SumsReply:
    """Answer to W_SUMS: ``sums[i]`` is the checksum (algorithm ``algo``, a
    :class:`~tiersync.net.frames.PayloadChecksum` value) of the i-th span's bytes in C order."""

    OP: ClassVar[WeightsOp] = WeightsOp.W_SUMS_REPLY
    request_id: int
    algo: int
    sums: tuple[int, ...]

    def __post_init__(self) -> None:
        check_u64("request_id", self.request_id)
        check_u64("algo", self.algo)
        check_u64s("sums", self.sums)
        if len(self.sums) > _MAX_SPANS:
            raise UsageError(f"must hold at most {_MAX_SPANS} sums", argument="sums")

    def meta(self) -> bytes:
        return MetaWriter().u64(self.algo).u64s(self.sums).getvalue()

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> SumsReply:
        return cls(rid, r.u64(), r.u64s(_MAX_SPANS))


WEIGHTS = Vocabulary(
    "weights",
    {Register: (Welcome,), Get: (ev.Data,), Sums: (SumsReply,)},
    oneway=(Announce, Ready, Ack, Release),
    include=(ev.CORE,),
)
"""What weight-sync connections speak (control and data alike)."""
