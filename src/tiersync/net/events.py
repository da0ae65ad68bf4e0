"""Protocol events: frozen slotted dataclasses, one per op (status enums: :mod:`tiersync.net.fields`).

The core vocabulary (:data:`CORE`: handshake, ERROR, PING/PONG, DATA) that every service
speaks, and the block store's (:data:`STORE`: offers, read leases, pulls). Each event knows
its :class:`~tiersync.net.frames.Op`, how to encode its metadata and how to parse it back. Constructing an event with bad fields raises
:class:`UsageError`; parsing bad metadata from a peer raises
:class:`~tiersync.net.errors.ProtocolError` (MALFORMED) instead.
Enum fields travel as u8; their values are wire format — never renumber.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import ClassVar, Union

import numpy as np

from tiersync.errors import UsageError
from tiersync.net.codec import KEY_SIZE, MetaReader, MetaWriter
from tiersync.net.errors import ProtocolError, ProtocolFault
from tiersync.net.fields import (CommitStatus, ErrorCode, LeaseStatus, OfferStatus, check_bytes, check_enum,
                                 check_keys, check_text, check_rows, check_u64, check_u64s)
from tiersync.net.frames import SUPPORTED, Op, PayloadChecksum, ProtocolConfig
from tiersync.net.vocab import Vocabulary

NONCE_SIZE = 16
PROOF_SIZE = 32


_PULL_META = struct.Struct(f"<QI{KEY_SIZE}sQQ")  # lease id, key length, key, offset, length
_ITEM = struct.Struct(f"<{KEY_SIZE}sQQ")  # one PULL_MANY / PULL_LOCAL item: key, offset, length
_REGION = struct.Struct("<QQQ")  # one LOCAL_REPLY region: address, length, checksum

MAX_CHECKSUMS = 16
_LOCAL_CHECKSUMS = tuple(int(a) for a in SUPPORTED)


@dataclass(frozen=True, slots=True)
class Hello:
    """Client -> server, first frame: who I am, a fresh nonce, and the payload checksum ids
    I verify (most preferred first; default: what this build has). Ids are raw ints so a
    newer peer's unknown ids parse (the server ignores them)."""

    OP: ClassVar[Op] = Op.HELLO
    node_id: str
    nonce: bytes
    checksums: tuple[int, ...] = _LOCAL_CHECKSUMS
    host: str = ""
    pid: int = 0

    def __post_init__(self) -> None:
        check_text("node_id", self.node_id)
        check_text("host", self.host)
        check_u64("pid", self.pid)
        check_bytes("nonce", self.nonce, (NONCE_SIZE,))
        if (not isinstance(self.checksums, tuple) or not 0 < len(self.checksums) <= MAX_CHECKSUMS
                or any(not isinstance(c, int) or not 0 <= c < 256 for c in self.checksums)):
            raise UsageError(f"must be a tuple of 1..{MAX_CHECKSUMS} ids in [0, 256)", argument="checksums")

    def meta(self) -> bytes:
        w = MetaWriter().text(self.node_id).blob(self.nonce).blob(bytes(self.checksums))
        return w.text(self.host).u64(self.pid).getvalue()

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> "Hello":
        return cls(r.text(cfg.max_string), r.blob(NONCE_SIZE), tuple(r.blob(MAX_CHECKSUMS)), r.text(cfg.max_string),
                   r.u64())


@dataclass(frozen=True, slots=True)
class Challenge:
    """Server -> client: the server nonce, the server's proof (empty when no token), and the
    payload checksum both sides use from now on (one the client offered)."""

    OP: ClassVar[Op] = Op.CHALLENGE
    nonce: bytes
    proof: bytes
    checksum: PayloadChecksum = PayloadChecksum.XXH3_64

    def __post_init__(self) -> None:
        check_bytes("nonce", self.nonce, (NONCE_SIZE,))
        check_bytes("proof", self.proof, (0, PROOF_SIZE))
        check_enum("checksum", self.checksum, PayloadChecksum)

    def meta(self) -> bytes:
        return MetaWriter().blob(self.nonce).blob(self.proof).u8(self.checksum).getvalue()

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> "Challenge":
        return cls(r.blob(NONCE_SIZE), r.blob(PROOF_SIZE), PayloadChecksum(r.u8()))


@dataclass(frozen=True, slots=True)
class Auth:
    """Client -> server: the client's proof (empty when it has no token)."""

    OP: ClassVar[Op] = Op.AUTH
    proof: bytes

    def __post_init__(self) -> None:
        check_bytes("proof", self.proof, (0, PROOF_SIZE))

    def meta(self) -> bytes:
        return MetaWriter().blob(self.proof).getvalue()

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> "Auth":
        return cls(r.blob(PROOF_SIZE))


@dataclass(frozen=True, slots=True)
class Ready:
    """Server -> client: handshake accepted; requests may flow both ways. ``host``/``pid``:
    the server's host identity and process (same-host reads, :mod:`tiersync.net.local`)."""

    OP: ClassVar[Op] = Op.READY
    session_id: int
    host: str = ""
    pid: int = 0

    def __post_init__(self) -> None:
        check_u64("session_id", self.session_id)
        check_text("host", self.host)
        check_u64("pid", self.pid)

    def meta(self) -> bytes:
        return MetaWriter().u64(self.session_id).text(self.host).u64(self.pid).getvalue()

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> "Ready":
        return cls(r.u64(), r.text(cfg.max_string), r.u64())


@dataclass(frozen=True, slots=True)
class Error:
    """Answer to request ``request_id``; with ``request_id == 0`` it ends the connection."""

    OP: ClassVar[Op] = Op.ERROR
    request_id: int
    code: ErrorCode
    message: str = ""

    def __post_init__(self) -> None:
        check_u64("request_id", self.request_id)
        check_enum("code", self.code, ErrorCode)
        check_text("message", self.message)

    def meta(self) -> bytes:
        return MetaWriter().u8(self.code).text(self.message).getvalue()

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> "Error":
        return cls(rid, ErrorCode(r.u8()), r.text(cfg.max_string))


@dataclass(frozen=True, slots=True)
class Ping:
    OP: ClassVar[Op] = Op.PING
    request_id: int
    token: int = 0

    def __post_init__(self) -> None:
        check_u64("request_id", self.request_id)
        check_u64("token", self.token)

    def meta(self) -> bytes:
        return MetaWriter().u64(self.token).getvalue()

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> "Ping":
        return cls(rid, r.u64())


@dataclass(frozen=True, slots=True)
class Pong:
    OP: ClassVar[Op] = Op.PONG
    request_id: int
    token: int = 0

    __post_init__ = Ping.__post_init__
    meta = Ping.meta

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> "Pong":
        return cls(rid, r.u64())


@dataclass(frozen=True, slots=True)
class Offer:
    """Writer -> destination: blocks ``keys`` (sizes in bytes) pullable under ``lease_id``.

    ``source``: the writer's "host:port" to pull from; an empty host (":port") means
    the address the destination sees the writer's connection come from.
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
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> "Offer":
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
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> "OfferReply":
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
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> "ReadLease":
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
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> "LeaseReply":
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
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> "Pull":
        fixed = r.peek_exact(_PULL_META)
        if fixed is not None and fixed[1] == KEY_SIZE:  # the usual layout: one unpack
            r.skip(_PULL_META.size)
            return cls(rid, fixed[0], fixed[2], fixed[3], fixed[4])
        return cls(rid, r.u64(), r.blob(KEY_SIZE), r.u64(), r.u64())


@dataclass(frozen=True, slots=True)
class Data:
    """Answer to a PULL (of any service): the bytes. ``payload`` may be any buffer, or a list of
    buffers sent back to back as one payload (a PULL_MANY's ranges); it is sent without a copy.
    A DATA received into several caller buffers has an empty ``payload``.

    ``payload_sum``: ``(algorithm, checksum)`` of exactly ``payload`` when the sender
    already knows it (e.g. recorded when an immutable block arrived): the connection
    sends it instead of re-reading the bytes when the algorithm is the negotiated one
    (a stale value makes the receiver refuse the frame, BAD_CHECKSUM). On a received
    DATA it is the verified checksum, so a receiver can keep it with the bytes. Not
    compared by ``==``.
    """

    OP: ClassVar[Op] = Op.DATA
    request_id: int
    payload: bytes | bytearray | memoryview
    payload_sum: tuple[PayloadChecksum, int] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        check_u64("request_id", self.request_id)
        parts = self.payload if isinstance(self.payload, (list, tuple)) else (self.payload,)
        if any(not isinstance(p, (bytes, bytearray, memoryview)) for p in parts):
            raise UsageError("must be a bytes-like buffer or a list of them", argument="payload")
        if self.payload_sum is not None:
            if not isinstance(self.payload_sum, tuple) or len(self.payload_sum) != 2:
                raise UsageError("must be (PayloadChecksum, int) or None", argument="payload_sum")
            check_enum("payload_sum", self.payload_sum[0], PayloadChecksum)
            check_u64("payload_sum", self.payload_sum[1])

    def meta(self) -> bytes:
        return b""

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> "Data":
        raise AssertionError("DATA is built by the Connection")  # pragma: no cover


def _check_items(name: str, items: object) -> None:
    if not isinstance(items, tuple) or not items:
        raise UsageError("must be a non-empty tuple of (key, offset, length)", argument=name)
    check_rows(name, items, (bytes, int, int))
    if any(len(item[0]) != KEY_SIZE for item in items):
        raise UsageError(f"keys must be {KEY_SIZE} bytes", argument=name)


def _write_items(w: MetaWriter, items: tuple) -> MetaWriter:
    w.u32(len(items))
    w.raw(b"".join(_ITEM.pack(*item) for item in items))
    return w


def _read_items(r: MetaReader, cfg: ProtocolConfig) -> tuple:
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
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> "PullMany":
        return cls(rid, r.u64(), _read_items(r, cfg))


@dataclass(frozen=True, slots=True)
class PullLocal:
    """Same-host PULL_MANY: instead of the bytes, the source answers LOCAL_REPLY with where they
    are in its memory, for the reader to copy with ``process_vm_readv``. Only sent when the
    handshake showed both ends on one host (:attr:`Ready.host`)."""

    OP: ClassVar[Op] = Op.PULL_LOCAL
    request_id: int
    lease_id: int
    items: tuple[tuple[bytes, int, int], ...]

    __post_init__ = PullMany.__post_init__
    meta = PullMany.meta

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> "PullLocal":
        return cls(rid, r.u64(), _read_items(r, cfg))


@dataclass(frozen=True, slots=True, eq=False)
class LocalReply:
    """Answer to PULL_LOCAL: process ``pid`` holds item ``i`` at ``regions[i] = (address,
    length, checksum)``, the checksum by ``algo`` (the connection's negotiated one). The bytes
    stay put while the lease holds; the reader verifies every checksum after its copy.
    ``regions`` is kept as a read-only ``(n, 3)`` uint64 array (a tuple of 3-tuples of ints is
    accepted): encoded, parsed and handed to the reader without Python work per region."""

    OP: ClassVar[Op] = Op.LOCAL_REPLY
    request_id: int
    pid: int
    algo: PayloadChecksum
    regions: np.ndarray

    def __post_init__(self) -> None:
        check_u64("request_id", self.request_id)
        check_u64("pid", self.pid)
        check_enum("algo", self.algo, PayloadChecksum)
        object.__setattr__(self, "regions", _region_array(self.regions))

    def __eq__(self, other: object) -> bool:
        return (type(other) is LocalReply and (self.request_id, self.pid, self.algo) ==
                (other.request_id, other.pid, other.algo) and np.array_equal(self.regions, other.regions))

    __hash__ = None  # type: ignore[assignment]

    def meta(self) -> bytes:
        return MetaWriter().u64(self.pid).u8(self.algo).u32(len(self.regions)).raw(self.regions.tobytes()).getvalue()

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> "LocalReply":
        pid, algo, n = r.u64(), PayloadChecksum(r.u8()), r.u32()
        if n > cfg.max_keys:
            raise ProtocolError("region count out of range", fault=ProtocolFault.MALFORMED, count=n)
        return cls(rid, pid, algo, np.frombuffer(r.take(n * _REGION.size), "<u8").reshape(n, 3))


def _region_array(regions: object) -> np.ndarray:
    """``regions`` as a fresh read-only little-endian (n, 3) uint64 array; UsageError naming
    ``regions`` for anything else."""
    if isinstance(regions, np.ndarray):
        if regions.dtype != np.uint64 or regions.ndim != 2 or regions.shape[1] != 3:
            raise UsageError("must be an (n, 3) uint64 array or a tuple of (address, length, checksum)",
                             argument="regions", got=f"{regions.dtype}{list(regions.shape)}")
        out = np.array(regions, dtype="<u8", order="C")
    else:
        check_rows("regions", regions, (int, int, int))
        out = np.array(regions, dtype="<u8").reshape(-1, 3)
    out.flags.writeable = False
    return out


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
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> "Release":
        return cls(rid, r.u64())


@dataclass(frozen=True, slots=True)
class CommitReply:
    """Final answer to an accepted OFFER or to a RELEASE."""

    OP: ClassVar[Op] = Op.COMMIT_REPLY
    request_id: int
    status: CommitStatus
    message: str = ""

    def __post_init__(self) -> None:
        check_u64("request_id", self.request_id)
        check_enum("status", self.status, CommitStatus)
        check_text("message", self.message)

    def meta(self) -> bytes:
        return MetaWriter().u8(self.status).text(self.message).getvalue()

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> "CommitReply":
        return cls(rid, CommitStatus(r.u8()), r.text(cfg.max_string))


@dataclass(frozen=True, slots=True)
class ConnectionClosed:
    """Local event: the peer closed the stream cleanly between frames. Never sent."""


CORE = Vocabulary("core", {Ping: (Pong,)}, responses=(Hello, Challenge, Auth, Ready, Error, Data))
"""What every connection speaks (the handshake classes are listed so their ops parse; the
protocol's state table decides when each is allowed)."""

STORE = Vocabulary("store", {Offer: (OfferReply,), ReadLease: (LeaseReply,), Pull: (Data,), PullMany: (Data,),
                             PullLocal: (LocalReply,), Release: (CommitReply,)}, responses=(CommitReply,),
                   include=(CORE,))
"""Block servers: store nodes, sources of offers, :class:`~tiersync.net.source.MemoryBlockSource`."""

Event = Union[Hello, Challenge, Auth, Ready, Error, Ping, Pong, Offer, OfferReply, ReadLease,
              LeaseReply, Pull, PullMany, PullLocal, LocalReply, Data, Release, CommitReply]
EVENT_TYPES: dict[Op, type] = {cls.OP: cls for cls in Event.__args__}  # type: ignore[attr-defined]
assert set(EVENT_TYPES) == set(Op)
