"""The fixed 64-byte little-endian frame header and the op codes.

Layout (``<4sHHIQIQQQ8sQ``, 64 bytes, no padding)::

    0   magic            4s   b"TSYN"
    4   version          u16  PROTOCOL_VERSION
    6   op               u16  an :class:`Op`
    8   flags            u32  must be 0 (reserved)
    12  request_id       u64
    20  meta_len         u32  bytes of metadata after the header
    24  payload_len      u64  bytes of payload after the metadata
    32  payload_checksum u64  xxh3_64 of the payload
    40  meta_checksum    u64  xxh3_64 of the metadata
    48  reserved         8s   must be zero
    56  header_checksum  u64  xxh3_64 of bytes 0..56

A frame is ``header | metadata | payload``. Checks run in this order: magic,
version, header checksum, op, flags/reserved, size bounds — so a length field is
never trusted before the checksum that covers it has passed.
"""
from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import xxhash

from tiersync.errors import UsageError, check_positive_int
from tiersync.net.errors import ProtocolError, ProtocolFault

MAGIC = b"TSYN"
PROTOCOL_VERSION = 1
HEADER_SIZE = 64
_HEADER = struct.Struct("<4sHHIQIQQQ8sQ")
_RESERVED = bytes(8)
assert _HEADER.size == HEADER_SIZE

_xxh3 = xxhash.xxh3_64_intdigest


def checksum(data: bytes | bytearray | memoryview) -> int:
    """xxh3_64 of ``data`` as an unsigned int."""
    return _xxh3(data)


class Op(enum.IntEnum):
    """Frame op codes. Values are wire format: never renumber."""

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


_OPS = frozenset(int(o) for o in Op)


@dataclass(frozen=True, slots=True)
class ProtocolConfig:
    """Bounds of what a :class:`~tiersync.net.protocol.Connection` accepts.

    ``max_frame_size``: largest metadata + payload of one frame (bytes).
    ``max_meta_size``: largest metadata of one frame. ``max_keys``: most keys in one
    OFFER / READ_LEASE. ``max_string``: longest string field (bytes, UTF-8).
    Raises :class:`UsageError` when a bound is not positive or meta > frame.
    """

    max_frame_size: int = 64 << 20
    max_meta_size: int = 1 << 20
    max_keys: int = 4096
    max_string: int = 1024

    def __post_init__(self) -> None:
        for name in ("max_frame_size", "max_meta_size", "max_keys", "max_string"):
            check_positive_int(getattr(self, name), name)
        if self.max_meta_size > self.max_frame_size:
            raise UsageError("must not exceed max_frame_size", argument="max_meta_size")
        if self.max_meta_size >= 1 << 32:
            raise UsageError("must fit in u32", argument="max_meta_size")


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """A decoded, validated header."""

    op: Op
    request_id: int
    meta_len: int
    payload_len: int
    payload_checksum: int
    meta_checksum: int


def encode_header(op: Op, request_id: int, meta: bytes, payload_len: int, payload_checksum: int) -> bytes:
    """Pack a header for ``meta`` (bytes) and a payload of ``payload_len`` bytes."""
    head = _HEADER.pack(
        MAGIC, PROTOCOL_VERSION, int(op), 0, request_id, len(meta), payload_len,
        payload_checksum, checksum(meta), _RESERVED, 0,
    )
    return head[:56] + checksum(head[:56]).to_bytes(8, "little")


def decode_header(raw: bytes | memoryview, config: ProtocolConfig) -> FrameHeader:
    """Validate and unpack 64 header bytes.

    Raises :class:`ProtocolError` (fault BAD_MAGIC, BAD_VERSION, BAD_CHECKSUM,
    UNKNOWN_OP, MALFORMED or OVERSIZE) — the sender's fault.
    """
    (magic, version, op, flags, request_id, meta_len, payload_len,
     payload_ck, meta_ck, reserved, header_ck) = _HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError("bad frame magic", fault=ProtocolFault.BAD_MAGIC, magic=bytes(magic))
    if version != PROTOCOL_VERSION:
        raise ProtocolError("unsupported protocol version", fault=ProtocolFault.BAD_VERSION,
                            version=version, supported=PROTOCOL_VERSION)
    if checksum(raw[:56]) != header_ck:
        raise ProtocolError("header checksum mismatch", fault=ProtocolFault.BAD_CHECKSUM)
    if op not in _OPS:
        raise ProtocolError("unknown op", fault=ProtocolFault.UNKNOWN_OP, op=op)
    if flags != 0 or reserved != _RESERVED:
        raise ProtocolError("reserved header bits set", fault=ProtocolFault.MALFORMED, flags=flags)
    if meta_len > config.max_meta_size or meta_len + payload_len > config.max_frame_size:
        raise ProtocolError("frame exceeds the configured bound", fault=ProtocolFault.OVERSIZE,
                            meta_len=meta_len, payload_len=payload_len, max_frame_size=config.max_frame_size)
    return FrameHeader(Op(op), request_id, meta_len, payload_len, payload_ck, meta_ck)
