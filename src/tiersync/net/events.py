"""Protocol events: frozen slotted dataclasses, one per op (status enums: :mod:`tiersync.net.fields`).

The core vocabulary (:data:`CORE`: handshake, ERROR, PING/PONG, DATA) that every service
speaks, and the responses services share (LOCAL_REPLY, COMMIT_REPLY); each service defines its
own operations on top (the block store's: :mod:`tiersync.net.store_ops`). Each event knows
its :class:`~tiersync.net.frames.Op`, how to encode its metadata and how to parse it back.
Constructing an event with bad fields raises
:class:`UsageError`; parsing bad metadata from a peer raises
:class:`~tiersync.net.errors.ProtocolError` (MALFORMED) instead.
Enum fields travel as u8; their values are wire format — never renumber.
"""

from __future__ import annotations

import enum
import itertools
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import numpy as np

from tiersync.errors import UsageError
from tiersync.net.codec import MetaReader, MetaWriter
from tiersync.net.errors import ProtocolError, ProtocolFault

# CommitStatus and ErrorCode are re-exported: users of this module spell ev.ErrorCode
from tiersync.net.fields import CommitStatus as CommitStatus
from tiersync.net.fields import ErrorCode as ErrorCode
from tiersync.net.fields import check_bytes, check_enum, check_rows, check_text, check_u64
from tiersync.net.frames import SUPPORTED, Op, PayloadChecksum, ProtocolConfig
from tiersync.net.vocab import Vocabulary

NONCE_SIZE = 16
PROOF_SIZE = 32


_BUFFERS = (bytes, bytearray, memoryview)  # what a DATA payload (or each of its parts) may be
_REGION = struct.Struct("<QQQ")  # one LOCAL_REPLY region: address, length, checksum

MAX_CHECKSUMS = 16
_LOCAL_CHECKSUMS = tuple(int(a) for a in SUPPORTED)


class Event(Protocol):
    """What a connection sends: an event class of some vocabulary (:mod:`tiersync.net.vocab`)."""

    @property
    def OP(self) -> enum.IntEnum: ...  # noqa: N802 - the event classes' OP (read-only: each narrows it)

    def meta(self) -> bytes: ...


class Request(Event, Protocol):
    """An event that names a request: a request, or an answer to one."""

    @property
    def request_id(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Hello:
    """Client -> server, first frame: who I am, a fresh nonce, and the payload checksum ids
    I verify (most preferred first; default: what this build has). Ids are raw ints so a
    newer peer's unknown ids parse (the server ignores them). ``max_frame``: the largest frame
    I accept (my ``max_frame_size``; 0: not stated), so the server sends none larger."""

    OP: ClassVar[Op] = Op.HELLO
    node_id: str
    nonce: bytes
    checksums: tuple[int, ...] = _LOCAL_CHECKSUMS
    host: str = ""
    pid: int = 0
    max_frame: int = 0

    def __post_init__(self) -> None:
        check_text("node_id", self.node_id)
        check_text("host", self.host)
        check_u64("pid", self.pid)
        check_u64("max_frame", self.max_frame)
        check_bytes("nonce", self.nonce, (NONCE_SIZE,))
        if (
            not isinstance(self.checksums, tuple)
            or not 0 < len(self.checksums) <= MAX_CHECKSUMS
            or any(not isinstance(c, int) or not 0 <= c < 256 for c in self.checksums)
        ):
            raise UsageError(f"must be a tuple of 1..{MAX_CHECKSUMS} ids in [0, 256)", argument="checksums")

    def meta(self) -> bytes:
        w = MetaWriter().text(self.node_id).blob(self.nonce).blob(bytes(self.checksums))
        return w.text(self.host).u64(self.pid).u64(self.max_frame).getvalue()

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> Hello:
        node_id, nonce, checksums = r.text(cfg.max_string), r.blob(NONCE_SIZE), tuple(r.blob(MAX_CHECKSUMS))
        return cls(node_id, nonce, checksums, r.text(cfg.max_string), r.u64(), r.u64())


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
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> Challenge:
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
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> Auth:
        return cls(r.blob(PROOF_SIZE))


@dataclass(frozen=True, slots=True)
class Ready:
    """Server -> client: handshake accepted; requests may flow both ways. ``host``/``pid``:
    the server's host identity and process (same-host reads, :mod:`tiersync.net.local`);
    ``max_frame``: the largest frame the server accepts and sends (0: not stated)."""

    OP: ClassVar[Op] = Op.READY
    session_id: int
    host: str = ""
    pid: int = 0
    max_frame: int = 0

    def __post_init__(self) -> None:
        check_u64("session_id", self.session_id)
        check_text("host", self.host)
        check_u64("pid", self.pid)
        check_u64("max_frame", self.max_frame)

    def meta(self) -> bytes:
        return MetaWriter().u64(self.session_id).text(self.host).u64(self.pid).u64(self.max_frame).getvalue()

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> Ready:
        return cls(r.u64(), r.text(cfg.max_string), r.u64(), r.u64())


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
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> Error:
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
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> Ping:
        return cls(rid, r.u64())


@dataclass(frozen=True, slots=True)
class Pong:
    OP: ClassVar[Op] = Op.PONG
    request_id: int
    token: int = 0

    def __post_init__(self) -> None:
        check_u64("request_id", self.request_id)
        check_u64("token", self.token)

    meta = Ping.meta

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> Pong:
        return cls(rid, r.u64())


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

    ``pinned``: the sender promises that the payload's bytes stay as they are until the peer
    has read them, not only until the DATA was written (a trainer's version, written over only
    after every sampler acknowledged it). A server session's writer on plain TCP then hands the
    kernel its pages instead of a copy (:func:`~tiersync.net.socket_io.write_nonblocking`); bytes changed too
    early reach the peer as a frame it refuses (BAD_CHECKSUM), never as other bytes. Not
    compared by ``==``.
    """

    OP: ClassVar[Op] = Op.DATA
    request_id: int
    payload: bytes | bytearray | memoryview | Sequence[bytes | bytearray | memoryview]
    payload_sum: tuple[PayloadChecksum, int] | None = field(default=None, compare=False)
    pinned: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        check_u64("request_id", self.request_id)
        parts = self.payload if isinstance(self.payload, (list, tuple)) else (self.payload,)
        if not all(map(isinstance, parts, itertools.repeat(_BUFFERS))):  # one C loop: a PULL_MANY has many
            raise UsageError("must be a bytes-like buffer or a list of them", argument="payload")
        if self.payload_sum is not None:
            if not isinstance(self.payload_sum, tuple) or len(self.payload_sum) != 2:
                raise UsageError("must be (PayloadChecksum, int) or None", argument="payload_sum")
            check_enum("payload_sum", self.payload_sum[0], PayloadChecksum)
            check_u64("payload_sum", self.payload_sum[1])

    def meta(self) -> bytes:
        return b""

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> Data:
        raise AssertionError("DATA is built by the Connection")  # pragma: no cover


@dataclass(frozen=True, slots=True, eq=False)
class LocalReply:
    """Answer to PULL_LOCAL: process ``pid`` holds item ``i`` at ``regions[i] = (address,
    length, checksum)``, the checksum by ``algo`` (the connection's negotiated one). The bytes
    stay put while the lease holds; the reader verifies every checksum after its copy.
    ``regions`` is kept as a read-only ``(n, 3)`` uint64 array (a tuple of 3-tuples of ints is
    accepted): encoded, parsed and handed to the reader without Python work per region.
    ``mapping``: ``(fd, address, nbytes, offset)`` when regions lie in memory the reader may
    map instead (``pid``'s file descriptor ``fd``, a sealed memfd, backs ``[address, address +
    nbytes)`` from file offset ``offset`` on: :mod:`tiersync.tiers.shareable`): those inside it
    are copied out of a map, the others with ``process_vm_readv``; a hint the reader checks,
    never trusts."""

    OP: ClassVar[Op] = Op.LOCAL_REPLY
    request_id: int
    pid: int
    algo: PayloadChecksum
    regions: np.ndarray
    mapping: tuple[int, int, int, int] | None = None

    def __post_init__(self) -> None:
        check_u64("request_id", self.request_id)
        check_u64("pid", self.pid)
        check_enum("algo", self.algo, PayloadChecksum)
        object.__setattr__(self, "regions", _region_array(self.regions))
        if self.mapping is not None:
            check_rows("mapping", (self.mapping,), (int, int, int, int))

    def __eq__(self, other: object) -> bool:
        return (
            type(other) is LocalReply
            and (self.request_id, self.pid, self.algo, self.mapping)
            == (other.request_id, other.pid, other.algo, other.mapping)
            and np.array_equal(self.regions, other.regions)
        )

    __hash__ = None  # type: ignore[assignment]

    def meta(self) -> bytes:
        w = MetaWriter().u64(self.pid).u8(self.algo).u32(len(self.regions)).raw(self.regions.tobytes())
        w.u8(self.mapping is not None)
        for value in self.mapping or ():
            w.u64(value)
        return w.getvalue()

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> LocalReply:
        pid, algo, n = r.u64(), PayloadChecksum(r.u8()), r.u32()
        if n > cfg.max_keys:
            raise ProtocolError("region count out of range", fault=ProtocolFault.MALFORMED, count=n)
        regions = np.frombuffer(r.take(n * _REGION.size), "<u8").reshape(n, 3)
        flag = r.u8()
        if flag > 1:
            raise ProtocolError("mapping flag out of range", fault=ProtocolFault.MALFORMED, flag=flag)
        mapping = (r.u64(), r.u64(), r.u64(), r.u64()) if flag else None
        return cls(rid, pid, algo, regions, mapping)


def _region_array(regions: object) -> np.ndarray:
    """``regions`` as a fresh read-only little-endian (n, 3) uint64 array; UsageError naming
    ``regions`` for anything else."""
    if isinstance(regions, np.ndarray):
        if regions.dtype != np.uint64 or regions.ndim != 2 or regions.shape[1] != 3:
            raise UsageError(
                "must be an (n, 3) uint64 array or a tuple of (address, length, checksum)",
                argument="regions",
                got=f"{regions.dtype}{list(regions.shape)}",
            )
        out = np.array(regions, dtype="<u8", order="C")
    else:
        check_rows("regions", regions, (int, int, int))
        out = np.array(regions, dtype="<u8").reshape(-1, 3)
    out.flags.writeable = False
    return out


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
    def parse(cls, rid: int, r: MetaReader, cfg: ProtocolConfig) -> CommitReply:
        return cls(rid, CommitStatus(r.u8()), r.text(cfg.max_string))


@dataclass(frozen=True, slots=True)
class ConnectionClosed:
    """Local event: the peer closed the stream cleanly between frames. Never sent."""


class _NeedData:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA = _NeedData()
"""Returned by :meth:`~tiersync.net.protocol.Connection.next_event` when more bytes are needed."""


CORE = Vocabulary("core", {Ping: (Pong,)}, responses=(Hello, Challenge, Auth, Ready, Error, Data))
"""What every connection speaks (the handshake classes are listed so their ops parse; the
protocol's state table decides when each is allowed)."""
