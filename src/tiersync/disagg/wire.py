"""Sans-IO framing of the prefill -> decode KV protocol (bytes in, frames out; no sockets).

Frame = 48-byte little-endian header | JSON metadata | payload::

    0  magic        4s  b"TSKV"
    4  version      u16 WIRE_VERSION
    6  kind         u16 a :class:`Kind`
    8  meta_len     u32
    12 flags        u32 must be 0
    16 payload_len  u64
    24 meta_ck      u64 xxh3_64 of the metadata
    32 payload_ck   u64 xxh3_64 of the payload
    40 header_ck    u64 xxh3_64 of bytes 0..40

Checks run magic, version, header checksum, kind, flags, bounds — a length is never trusted
before the checksum covering it passed; metadata must be a JSON object; a payload checksum
is verified before the payload is handed out. Any violation raises
:class:`~tiersync.net.errors.ProtocolError` and poisons the decoder: the connection must close.

Flow (decode side = client): HELLO{nonce} -> CHALLENGE{nonce, proof} -> AUTH{proof} -> READY;
then READ{...} -> LAYER{layer, offset} x n (payload = the route's bytes of that layer) ->
DONE from the client; ERROR{code, message} ends the exchange from either side.
"""
from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass
from typing import Any, Sequence

import xxhash

from tiersync.errors import UsageError, check_positive_int
from tiersync.net.errors import ProtocolError, ProtocolFault

__all__ = ["Decoder", "Frame", "Kind", "NEED_DATA", "WIRE_VERSION", "WireLimits", "encode"]

MAGIC = b"TSKV"
WIRE_VERSION = 1
_HEADER = struct.Struct("<4sHHIIQQQ")
HEADER_SIZE = _HEADER.size + 8
assert HEADER_SIZE == 48
NEED_DATA = object()


class Kind(enum.IntEnum):
    """Frame kinds. Values are wire format: never renumber."""

    HELLO = 1
    CHALLENGE = 2
    AUTH = 3
    READY = 4
    ERROR = 5
    READ = 6
    LAYER = 7
    DONE = 8


_KINDS = frozenset(int(k) for k in Kind)


@dataclass(frozen=True, slots=True)
class WireLimits:
    """Largest metadata and payload of one frame a decoder accepts (bytes, > 0)."""

    max_meta: int = 4 << 20
    max_payload: int = 256 << 20

    def __post_init__(self) -> None:
        check_positive_int(self.max_meta, "max_meta")
        check_positive_int(self.max_payload, "max_payload")
        if self.max_meta >= 1 << 32:
            raise UsageError("must fit in u32", argument="max_meta")


@dataclass(frozen=True, slots=True)
class Frame:
    """A decoded frame. ``payload`` is None until the payload is complete and verified; it is
    the sink view handed to :meth:`Decoder.set_sink`, or a fresh buffer."""

    kind: Kind
    meta: dict
    payload_len: int
    payload: memoryview | None = None


def _ck(data: Any) -> int:
    return xxhash.xxh3_64_intdigest(data)


def encode(kind: Kind, meta: dict | None = None, payload: Sequence[Any] = ()) -> list[memoryview]:
    """The buffers of one frame (header+meta first, then the payload buffers, not copied)."""
    raw = json.dumps(meta or {}, separators=(",", ":")).encode()
    views = [memoryview(p).cast("B") for p in payload]
    views = [v for v in views if v.nbytes]
    hasher = xxhash.xxh3_64()
    for v in views:
        hasher.update(v)
    size = sum(v.nbytes for v in views)
    head = _HEADER.pack(MAGIC, WIRE_VERSION, int(kind), len(raw), 0, size, _ck(raw), hasher.intdigest())
    return [memoryview(head + _ck(head).to_bytes(8, "little") + raw)] + views


class _State(enum.Enum):
    HEADER = 1
    META = 2
    SINK = 3  # header+meta decoded, waiting for set_sink (or the next recv_view)
    PAYLOAD = 4
    CLOSED = 5


class Decoder:
    """Incremental frame decoder. Loop: ``view = recv_view()``; read into it (``recv_into``);
    ``received(n)`` (``n == 0`` is EOF); ``next_event()`` until it returns :data:`NEED_DATA`.

    ``next_event`` returns a :class:`Frame` twice for a frame with a payload: first with
    ``payload=None`` once header and metadata are verified (call :meth:`set_sink` then to
    receive the payload in place), then with the verified payload. ``None`` means EOF between
    frames. Raises :class:`ProtocolError` (fault) on any violation; the decoder stays poisoned.
    """

    def __init__(self, limits: WireLimits = WireLimits()) -> None:
        self._limits = limits
        self._state = _State.HEADER
        self._buf: memoryview = memoryview(bytearray(HEADER_SIZE))
        self._pos = 0
        self._head: tuple | None = None
        self._frame: Frame | None = None
        self._error: ProtocolError | None = None
        self._eof = False

    def set_sink(self, view: memoryview | None) -> None:
        """Receive the pending payload into ``view`` (exactly ``payload_len`` writable bytes)."""
        if self._state is not _State.SINK:
            raise UsageError("no payload is pending", argument="view")
        if view is None:
            view = memoryview(bytearray(self._frame.payload_len))
        view = memoryview(view).cast("B")
        if view.nbytes != self._frame.payload_len or view.readonly:
            raise UsageError("must be writable and exactly payload_len bytes", argument="view",
                             nbytes=view.nbytes, payload_len=self._frame.payload_len)
        self._buf, self._pos, self._state = view, 0, _State.PAYLOAD

    def recv_view(self) -> memoryview:
        """Where the next received bytes go (never empty while the decoder is open)."""
        self._raise_if_failed()
        if self._state is _State.SINK:
            self.set_sink(None)
        return self._buf[self._pos:]

    def received(self, n: int) -> None:
        """``n`` bytes were written into the last :meth:`recv_view`; 0 means the peer closed."""
        if n == 0:
            self._eof = True
            if self._state is not _State.HEADER or self._pos:
                self._fail("connection closed inside a frame", ProtocolFault.TRUNCATED)
            return
        self._pos += n

    def next_event(self) -> Frame | None | object:
        """The next :class:`Frame`, ``None`` at a clean EOF, or :data:`NEED_DATA`."""
        self._raise_if_failed()
        if self._state is _State.HEADER and self._pos == HEADER_SIZE:
            self._take_header()
        if self._state is _State.META and self._pos == len(self._buf):
            return self._take_meta()
        if self._state is _State.PAYLOAD and self._pos == len(self._buf):
            return self._take_payload()
        if self._eof and self._state is _State.HEADER and not self._pos:
            self._state = _State.CLOSED
            return None
        return NEED_DATA

    def _take_header(self) -> None:
        raw = bytes(self._buf)
        magic, version, kind, meta_len, flags, payload_len, meta_ck, payload_ck = _HEADER.unpack(raw[:40])
        if magic != MAGIC:
            self._fail("bad frame magic", ProtocolFault.BAD_MAGIC, magic=magic)
        if version != WIRE_VERSION:
            self._fail("unsupported wire version", ProtocolFault.BAD_VERSION, version=version)
        if _ck(raw[:40]) != int.from_bytes(raw[40:], "little"):
            self._fail("header checksum mismatch", ProtocolFault.BAD_CHECKSUM)
        if kind not in _KINDS:
            self._fail("unknown frame kind", ProtocolFault.UNKNOWN_OP, kind=kind)
        if flags:
            self._fail("reserved flags set", ProtocolFault.MALFORMED, flags=flags)
        if meta_len > self._limits.max_meta or payload_len > self._limits.max_payload:
            self._fail("frame exceeds the configured bound", ProtocolFault.OVERSIZE,
                       meta_len=meta_len, payload_len=payload_len)
        self._head = (Kind(kind), meta_len, payload_len, meta_ck, payload_ck)
        self._buf, self._pos, self._state = memoryview(bytearray(meta_len)), 0, _State.META

    def _take_meta(self) -> Frame | object:
        kind, meta_len, payload_len, meta_ck, _ = self._head
        if _ck(self._buf) != meta_ck:
            self._fail("metadata checksum mismatch", ProtocolFault.BAD_CHECKSUM)
        try:
            meta = json.loads(bytes(self._buf)) if meta_len else {}
        except (ValueError, UnicodeDecodeError):
            meta = None
        if not isinstance(meta, dict):
            self._fail("metadata is not a JSON object", ProtocolFault.MALFORMED)
        self._frame = Frame(kind, meta, payload_len)
        if payload_len == 0:
            self._reset()
            return Frame(kind, meta, 0, memoryview(b""))
        self._state = _State.SINK
        return self._frame

    def _take_payload(self) -> Frame:
        if _ck(self._buf) != self._head[4]:
            self._fail("payload checksum mismatch", ProtocolFault.BAD_CHECKSUM)
        frame = Frame(self._frame.kind, self._frame.meta, self._frame.payload_len, self._buf)
        self._reset()
        return frame

    def _reset(self) -> None:
        self._buf, self._pos, self._state = memoryview(bytearray(HEADER_SIZE)), 0, _State.HEADER
        self._head = self._frame = None

    def _fail(self, message: str, fault: ProtocolFault, **context: Any) -> None:
        self._error = ProtocolError(message, fault=fault, **context)
        self._state = _State.CLOSED
        raise self._error

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error
        if self._state is _State.CLOSED:
            raise ProtocolError("decoder is closed", fault=ProtocolFault.UNEXPECTED)
