"""The fixed 64-byte little-endian frame header and the op codes.

Layout (``<4sHHIQIQQQB7sQ``, 64 bytes, no padding)::

    0   magic            4s   b"TSYN"
    4   version          u16  PROTOCOL_VERSION
    6   op               u16  an op of the connection's vocabulary (:mod:`tiersync.net.vocab`)
    8   flags            u32  must be 0 (reserved)
    12  request_id       u64
    20  meta_len         u32  bytes of metadata after the header
    24  payload_len      u64  bytes of payload after the metadata
    32  payload_checksum u64  the payload's checksum, by the algorithm at byte 48
    40  meta_checksum    u64  xxh3_64 of the metadata
    48  payload_algo     u8   a :class:`PayloadChecksum` id
    49  reserved         7s   must be zero
    56  header_checksum  u64  xxh3_64 of bytes 0..56

A frame is ``header | metadata | payload``. Checks run in this order: magic,
version, header checksum, op, flags/reserved, payload algorithm, size bounds — so
a length field is never trusted before the checksum that covers it has passed.

Payload checksums: every frame names the algorithm its payload was summed with,
so a receiver never verifies with the wrong one; an id it does not implement is
refused (BAD_CHECKSUM, naming the id). HELLO lists the algorithms the client
verifies, CHALLENGE names the server's pick (:func:`negotiate`), and both sides
then sum their payloads with it. ``XXH3_64`` (the ``xxhash`` package, holds the
GIL) is in every build; ``TSUM64`` (tiersync's native checksum, GIL released) is
offered only when the extension is built. Header and metadata always use xxh3.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple, Protocol, cast

import xxhash

from tiersync.errors import UsageError, check_positive_int
from tiersync.net.errors import ProtocolError, ProtocolFault
from tiersync.transfer import kernel

MAGIC = b"TSYN"
PROTOCOL_VERSION = 7
# 2: payload checksum negotiation; 3: service vocabularies, host identity in HELLO/READY; 4: LOCAL_REPLY
# mapping; 5: each end's max_frame_size in HELLO/READY; 6: LOCAL_REPLY's mapping has a file offset
# and may hold only some of the regions; 7: weight sync's W_WELCOME, W_GET and W_SUMS carry the
# trainer's incarnation
HEADER_SIZE = 64
_HEADER = struct.Struct("<4sHHIQIQQQB7sQ")
_RESERVED = bytes(7)
assert _HEADER.size == HEADER_SIZE

_xxh3 = xxhash.xxh3_64_intdigest
_EMPTY_XXH3 = _xxh3(b"")
EMPTY_META_CHECKSUM = _EMPTY_XXH3
"""The ``meta_checksum`` of a frame without metadata (xxh3_64 of no bytes)."""


def checksum(data: bytes | bytearray | memoryview) -> int:
    """xxh3_64 of ``data`` as an unsigned int (headers, metadata, XXH3_64 payloads)."""
    return _xxh3(data)


class PayloadChecksum(enum.IntEnum):
    """Payload checksum algorithms. Values are wire format: never renumber."""

    XXH3_64 = 0  # the xxhash package: every build
    TSUM64 = 1  # tiersync.transfer.kernel.tsum64: builds with the native extension


SUPPORTED: tuple[PayloadChecksum, ...] = (
    (PayloadChecksum.TSUM64, PayloadChecksum.XXH3_64) if kernel.TSUM64 is not None else (PayloadChecksum.XXH3_64,)
)
"""What this build verifies, most preferred first."""


def payload_checksum(algo: PayloadChecksum, data: bytes | bytearray | memoryview) -> int:
    """Checksum of ``data`` by ``algo``. Raises UsageError when this build lacks ``algo``."""
    if algo is PayloadChecksum.TSUM64 and kernel.TSUM64 is not None:
        return kernel.tsum64(data)
    if algo is PayloadChecksum.XXH3_64:
        return _xxh3(data)
    raise UsageError(f"payload checksum {algo!r} is not available in this build", argument="algo")


class Hasher(Protocol):
    """An incremental payload checksum: ``update`` with each part in order, then ``intdigest``."""

    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...

    def intdigest(self) -> int: ...


def payload_hasher(algo: PayloadChecksum) -> Hasher:
    """An incremental hasher (``update``, ``intdigest``) for ``algo``; UsageError when unavailable."""
    if algo is PayloadChecksum.TSUM64 and kernel.TSUM64 is not None:
        return cast(Hasher, kernel.tsum64_hasher())  # a native Tsum64 (typed object there)
    if algo is PayloadChecksum.XXH3_64:
        return xxhash.xxh3_64()
    raise UsageError(f"payload checksum {algo!r} is not available in this build", argument="algo")


_ALGOS = frozenset(int(a) for a in SUPPORTED)
_ALGO_OF = {int(a): a for a in SUPPORTED}
EMPTY_CHECKSUM = {a: payload_checksum(a, b"") for a in SUPPORTED}
"""Checksum of an empty payload, per algorithm this build has."""


def negotiate(offered: tuple[int, ...]) -> PayloadChecksum:
    """The first of :data:`SUPPORTED` that the peer ``offered`` (raw ids, unknown ones ignored).

    Raises ProtocolError(MALFORMED) when nothing is in common (every build has XXH3_64,
    so only a broken or foreign peer gets there).
    """
    for algo in SUPPORTED:
        if int(algo) in offered:
            return algo
    raise ProtocolError(
        "no payload checksum in common with the peer",
        fault=ProtocolFault.MALFORMED,
        offered=list(offered),
        supported=[a.name for a in SUPPORTED],
    )


class Op(enum.IntEnum):
    """Op codes of the core protocol (1-15, and DATA) and of the block store (16-31). Other
    services number theirs from 32 (prefill -> decode) and 48 (weights). Wire format: never
    renumber."""

    HELLO = 1
    CHALLENGE = 2
    AUTH = 3
    READY = 4
    ERROR = 5
    PING = 6
    PONG = 7
    OFFER = 16
    OFFER_REPLY = 17
    READ_LEASE = 18
    LEASE_REPLY = 19
    PULL = 20
    DATA = 21
    RELEASE = 22
    COMMIT_REPLY = 23
    PULL_MANY = 24
    PULL_LOCAL = 25
    LOCAL_REPLY = 26


MIN_FRAME_SIZE = 4096
"""The least ``max_frame_size``: of a config here, and of what a peer states in HELLO/READY (a
hostile few bytes would cut every pull into countless pieces)."""


@dataclass(frozen=True, slots=True)
class ProtocolConfig:
    """Bounds of what a :class:`~tiersync.net.protocol.Connection` accepts.

    ``max_frame_size``: largest metadata + payload of one frame (bytes).
    ``max_meta_size``: largest metadata of one frame. ``max_keys``: most keys in one
    OFFER / READ_LEASE. ``max_string``: longest string field (bytes, UTF-8).
    Raises :class:`UsageError` when a bound is not positive, meta > frame, or the frame is
    below :data:`MIN_FRAME_SIZE` (the least a peer may state in the handshake).
    """

    max_frame_size: int = 64 << 20
    max_meta_size: int = 1 << 20
    max_keys: int = 4096
    max_string: int = 1024

    def __post_init__(self) -> None:
        for name in ("max_frame_size", "max_meta_size", "max_keys", "max_string"):
            check_positive_int(getattr(self, name), name)
        if self.max_frame_size < MIN_FRAME_SIZE:
            raise UsageError(f"must be at least {MIN_FRAME_SIZE}", argument="max_frame_size", value=self.max_frame_size)
        if self.max_meta_size > self.max_frame_size:
            raise UsageError("must not exceed max_frame_size", argument="max_meta_size")
        if self.max_meta_size >= 1 << 32:
            raise UsageError("must fit in u32", argument="max_meta_size")


class FrameHeader(NamedTuple):
    """A decoded, validated header (a named tuple: built once per frame, cheaply)."""

    op: enum.IntEnum
    request_id: int
    meta_len: int
    payload_len: int
    payload_checksum: int
    meta_checksum: int
    payload_algo: PayloadChecksum = PayloadChecksum.XXH3_64


_HEAD56 = struct.Struct("<4sHHIQIQQQB7s")


def encode_header(
    op: int,
    request_id: int,
    meta: bytes,
    payload_len: int,
    payload_checksum: int,
    payload_algo: PayloadChecksum = PayloadChecksum.XXH3_64,
) -> bytes:
    """Pack a header for ``meta`` (bytes) and a payload of ``payload_len`` bytes summed by ``payload_algo``."""
    head = _HEAD56.pack(
        MAGIC,
        PROTOCOL_VERSION,
        op,
        0,
        request_id,
        len(meta),
        payload_len,
        payload_checksum,
        _xxh3(meta) if meta else _EMPTY_XXH3,
        payload_algo,
        _RESERVED,
    )
    return head + _xxh3(head).to_bytes(8, "little")


def decode_header(raw: bytes | memoryview, config: ProtocolConfig, ops: Mapping[int, enum.IntEnum]) -> FrameHeader:
    """Validate and unpack 64 header bytes; ``ops``: raw op code -> member, the ops the
    connection's vocabulary knows.

    Raises :class:`ProtocolError` (fault BAD_MAGIC, BAD_VERSION, BAD_CHECKSUM,
    UNKNOWN_OP, MALFORMED or OVERSIZE) — the sender's fault.
    """
    (magic, version, op, flags, request_id, meta_len, payload_len, payload_ck, meta_ck, algo, reserved, header_ck) = (
        _HEADER.unpack(raw)
    )
    if magic != MAGIC:
        raise ProtocolError("bad frame magic", fault=ProtocolFault.BAD_MAGIC, magic=bytes(magic))
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            "unsupported protocol version", fault=ProtocolFault.BAD_VERSION, version=version, supported=PROTOCOL_VERSION
        )
    if checksum(raw[:56]) != header_ck:
        raise ProtocolError("header checksum mismatch", fault=ProtocolFault.BAD_CHECKSUM)
    member = ops.get(op)
    if member is None:
        raise ProtocolError("unknown op", fault=ProtocolFault.UNKNOWN_OP, op=op)
    if flags != 0 or reserved != _RESERVED:
        raise ProtocolError("reserved header bits set", fault=ProtocolFault.MALFORMED, flags=flags)
    if algo not in _ALGOS:
        raise ProtocolError(
            f"payload checksum algorithm {algo} is not supported by this build",
            fault=ProtocolFault.BAD_CHECKSUM,
            algo=algo,
            supported=[a.name for a in SUPPORTED],
        )
    if meta_len > config.max_meta_size or meta_len + payload_len > config.max_frame_size:
        raise ProtocolError(
            "frame exceeds the configured bound",
            fault=ProtocolFault.OVERSIZE,
            meta_len=meta_len,
            payload_len=payload_len,
            max_frame_size=config.max_frame_size,
        )
    return FrameHeader(member, request_id, meta_len, payload_len, payload_ck, meta_ck, _ALGO_OF[algo])
