"""The weight-sync wire format: length-prefixed, checksummed, size-bounded messages.

A message is ``header | metadata | payload``. The 48-byte little-endian header
(``<4sHHIIQQQQ``)::

    0  magic        4s  b"TSWT"
    4  version      u16 WIRE_VERSION
    6  op           u16 an :class:`Op`
    8  meta_len     u32 bytes of JSON metadata (bounded by the reader's ``max_meta``)
    12 flags        u32 bit 0: the payload is checksummed
    16 payload_len  u64 bytes of payload (never trusted alone: the reader says how many
                        it expects, and a mismatch is a protocol error)
    24 payload_ck   u64 xxh3_64 of the payload (0 unless flag bit 0)
    32 meta_ck      u64 xxh3_64 of the metadata
    40 header_ck    u64 xxh3_64 of bytes 0..40

Checks run magic, version, header checksum, op, bounds, metadata checksum, so no length is
used before the checksum covering it passed. Every socket call runs under a
:class:`Deadline`. Errors: :class:`~tiersync.net.errors.ProtocolError` (bad bytes),
:class:`~tiersync.net.errors.NetTimeoutError`, :class:`~tiersync.net.errors.PeerClosedError`.
"""
from __future__ import annotations

import enum
import json
import socket
import struct
from dataclasses import dataclass
from typing import Any, Sequence

import xxhash

from tiersync.iov import consume
from tiersync.net.errors import NetTimeoutError, PeerClosedError, ProtocolError, ProtocolFault
from tiersync.net.framed import Deadline, io_errors  # one deadline type and error mapping for every socket

__all__ = ["Deadline", "Forever", "Message", "Op", "connect", "payload_checksum", "recv_message", "recv_payload",
           "send_message", "tune"]

MAGIC = b"TSWT"
WIRE_VERSION = 1
_HEADER = struct.Struct("<4sHHIIQQQQ")
HEADER_SIZE = _HEADER.size
FLAG_CHECKSUM = 1
_IOV_MAX = 512
_SOCK_BUF = 16 << 20
_PIECE = 1 << 20  # bytes one recv waits for inside a payload: few calls, hashed while in cache
assert HEADER_SIZE == 48


class Op(enum.IntEnum):
    """Message kinds. Values are wire format: never renumber."""

    HELLO = 1  #: sampler -> publisher: register (rank, host, transport, relay address)
    WELCOME = 2  #: publisher -> sampler: registration accepted (or ERROR)
    ANNOUNCE = 3  #: publisher -> sampler: version v is being written (manifest, peers)
    READY = 4  #: publisher -> sampler: the first ``count`` tensors of v are complete
    ACK = 5  #: sampler -> publisher: outcome of version v
    DATA_HELLO = 6  #: a data connection opens (no answer)
    GET = 7  #: request the bytes of one span of one tensor of version v
    DATA = 8  #: answer to GET, payload = the span's bytes in C order
    ERROR = 9  #: a refused request or registration (meta: message)
    RELEASE = 10  #: zero-copy sampler -> publisher: it no longer reads version v's segment


_OPS = frozenset(int(o) for o in Op)


class Forever(Deadline):
    """A deadline that never passes: an idle connection may wait for its next message."""

    def __init__(self, peer: str) -> None:
        super().__init__(1.0, peer)

    def remaining(self) -> float:
        return None  # type: ignore[return-value]  # settimeout(None): block


@dataclass(frozen=True, slots=True)
class Message:
    """A received header and metadata; the payload (``payload_len`` bytes) is still unread."""

    op: Op
    meta: dict[str, Any]
    payload_len: int
    payload_ck: int
    checksummed: bool


def tune(sock: socket.socket) -> None:
    """16 MiB socket buffers and TCP_NODELAY."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCK_BUF)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCK_BUF)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def connect(address: str, timeout: float) -> socket.socket:
    """A tuned TCP connection to ``"host:port"``; PeerClosedError / NetTimeoutError on failure."""
    host, _, port = address.rpartition(":")
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    except socket.timeout as exc:
        raise NetTimeoutError("connect timed out", peer=address) from exc
    except OSError as exc:
        raise PeerClosedError(f"connect failed: {exc}", peer=address) from exc
    tune(sock)
    return sock


def payload_checksum(views: Sequence[memoryview]) -> int:
    """xxh3_64 of the concatenated ``views`` (what ``payload_ck`` carries)."""
    h = xxhash.xxh3_64()
    for v in views:
        h.update(v)
    return h.intdigest()


def send_message(sock: socket.socket, op: Op, meta: dict[str, Any], deadline: Deadline,
                 payload: Sequence[memoryview] = (), *, checksum: bool = False, known_ck: int | None = None) -> None:
    """Send one message; ``payload`` is a list of byte views sent with scatter-gather writes.
    ``known_ck``: the payload's :func:`payload_checksum`, when the caller has it already."""
    raw_meta = json.dumps(meta, separators=(",", ":")).encode()
    views = [memoryview(p).cast("B") for p in payload if len(p)]
    total = sum(len(v) for v in views)
    ck = 0
    if checksum and views:
        ck = payload_checksum(views) if known_ck is None else known_ck
    head = _HEADER.pack(MAGIC, WIRE_VERSION, int(op), len(raw_meta), FLAG_CHECKSUM if checksum else 0,
                        total, ck, xxhash.xxh3_64_intdigest(raw_meta), 0)
    head = head[:40] + xxhash.xxh3_64_intdigest(head[:40]).to_bytes(8, "little")
    out = [memoryview(head), memoryview(raw_meta), *views]
    with io_errors(deadline.peer):
        while out:
            sock.settimeout(deadline.remaining())
            consume(out, sock.sendmsg(out[:_IOV_MAX]))


def recv_message(sock: socket.socket, deadline: Deadline, max_meta: int) -> Message:
    """Read one header and its metadata; the payload is left for :func:`recv_payload`.

    Raises PeerClosedError on EOF before a header, ProtocolError on bad bytes.
    """
    head = _recv_exact(sock, HEADER_SIZE, deadline, at_start=True)
    magic, version, op, meta_len, flags, payload_len, payload_ck, meta_ck, header_ck = _HEADER.unpack(head)
    peer = deadline.peer
    if magic != MAGIC:
        raise ProtocolError("bad message magic", fault=ProtocolFault.BAD_MAGIC, peer=peer)
    if version != WIRE_VERSION:
        raise ProtocolError("unsupported wire version", fault=ProtocolFault.BAD_VERSION, peer=peer, version=version)
    if xxhash.xxh3_64_intdigest(head[:40]) != header_ck:
        raise ProtocolError("header checksum mismatch", fault=ProtocolFault.BAD_CHECKSUM, peer=peer)
    if op not in _OPS:
        raise ProtocolError("unknown op", fault=ProtocolFault.UNKNOWN_OP, peer=peer, op=op)
    if meta_len > max_meta or flags & ~FLAG_CHECKSUM:
        raise ProtocolError("metadata too large or unknown flags", fault=ProtocolFault.OVERSIZE, peer=peer,
                            meta_len=meta_len, max_meta=max_meta)
    raw = _recv_exact(sock, meta_len, deadline)
    if xxhash.xxh3_64_intdigest(raw) != meta_ck:
        raise ProtocolError("metadata checksum mismatch", fault=ProtocolFault.BAD_CHECKSUM, peer=peer)
    try:
        meta = json.loads(raw) if raw else {}
    except ValueError as exc:
        raise ProtocolError("metadata is not JSON", fault=ProtocolFault.MALFORMED, peer=peer) from exc
    if not isinstance(meta, dict):
        raise ProtocolError("metadata is not an object", fault=ProtocolFault.MALFORMED, peer=peer)
    return Message(Op(op), meta, payload_len, payload_ck, bool(flags & FLAG_CHECKSUM))


def recv_payload(sock: socket.socket, msg: Message, into: memoryview, deadline: Deadline, *, verify: bool) -> None:
    """Receive ``msg``'s payload straight into ``into`` (exactly its size) and check it.

    ProtocolError (OVERSIZE) when the announced length differs from ``len(into)``;
    ProtocolError (BAD_CHECKSUM) when ``verify`` and the xxh3 does not match.
    """
    view = memoryview(into).cast("B")
    if msg.payload_len != len(view):
        raise ProtocolError("payload length differs from the request", fault=ProtocolFault.OVERSIZE,
                            peer=deadline.peer, got=msg.payload_len, expected=len(view))
    got, h = 0, xxhash.xxh3_64() if verify and msg.checksummed else None
    with io_errors(deadline.peer):
        while got < len(view):
            sock.settimeout(deadline.remaining())
            piece = view[got: got + _PIECE]
            n = sock.recv_into(piece, 0, socket.MSG_WAITALL)
            if n == 0:
                raise PeerClosedError("connection closed inside a payload", peer=deadline.peer)
            if h is not None:  # hashed while the piece is still in cache
                h.update(piece[:n])
            got += n
    if h is not None and h.intdigest() != msg.payload_ck:
        raise ProtocolError("payload checksum mismatch", fault=ProtocolFault.BAD_CHECKSUM, peer=deadline.peer)


def _recv_exact(sock: socket.socket, n: int, deadline: Deadline, *, at_start: bool = False) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    with io_errors(deadline.peer):
        while got < n:
            sock.settimeout(deadline.remaining())
            k = sock.recv_into(view[got:])
            if k == 0:
                what = "connection closed" if at_start and got == 0 else "connection closed inside a message"
                raise PeerClosedError(what, peer=deadline.peer)
            got += k
    return bytes(buf)
