"""The receive side of one connection: bytes in, verified events out (sans-IO).

A :class:`FrameReader` is the part of :class:`~tiersync.net.protocol.Connection` that parses:
it buffers the peer's bytes, decodes each frame's header, checks its metadata checksum, lands
its payload (in a buffer of its own, or in place in a caller's buffer registered with
:meth:`FrameReader.expect_payload_into`), verifies the payload checksum incrementally as the
bytes arrive, and turns the frame into an event of the vocabulary. What the peer may send now,
and what an answer finishes, is the :class:`~tiersync.net.ledger.Ledger`'s (shared with the
sending side, handed in).

The in-place receive API lets a socket layer skip the copy: :meth:`~FrameReader.payload_sink`
/ :meth:`~FrameReader.payload_received` (``recv_into`` the caller's buffer),
:meth:`~FrameReader.scatter_target` / :meth:`~FrameReader.scatter_received` (one header and
the predicted payload in one scatter read), :meth:`~FrameReader.data_fast_targets` /
:meth:`~FrameReader.data_fast_received` (whole DATA frames received and verified by a native
receiver), and :meth:`~FrameReader.read_hint` (read no further than the header in front of
such a payload).

Memory: nothing is allocated from a peer-declared size beyond :class:`ProtocolConfig` bounds;
payload buffers grow only as bytes arrive. Before the handshake is done a frame may carry at
most :func:`handshake_limit` bytes (the largest a handshake message can be), so a peer that has
not authenticated makes a server buffer no more than that. A :class:`ProtocolError` poisons
the connection.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Sequence

from tiersync.errors import ClosedError, UsageError
from tiersync.net import events as ev
from tiersync.net.errors import ProtocolError, ProtocolFault
from tiersync.net.events import NEED_DATA
from tiersync.net.frames import (
    EMPTY_CHECKSUM,
    HEADER_SIZE,
    FrameHeader,
    Hasher,
    Op,
    PayloadChecksum,
    ProtocolConfig,
    checksum,
    decode_header,
    payload_hasher,
)
from tiersync.net.ledger import Ledger
from tiersync.net.pieces import Pieces, byte_views, bytes_view
from tiersync.net.states import State
from tiersync.net.vocab import Vocabulary

__all__ = ["FrameReader", "handshake_limit"]

_FAST_ALGO = PayloadChecksum.TSUM64  # what a native receiver verifies (data_fast_targets)
_EMPTY = memoryview(b"")
_READONLY = operator.attrgetter("readonly")


def handshake_limit(config: ProtocolConfig) -> int:
    """Most metadata + payload bytes of a frame before READY: a HELLO's two strings of at most
    ``max_string`` bytes and its few fixed fields (nonce, checksum ids, pid, lengths)."""
    return 2 * config.max_string + 1024


class FrameReader:
    """Parse state of one connection side: the read buffer, the frame being received, and the
    caller buffers registered for DATA answers. ``config``: bounds; ``ledger``: the connection's
    handshake state and outstanding requests; ``vocabulary``: the ops and how to parse them."""

    def __init__(self, config: ProtocolConfig, ledger: Ledger, vocabulary: Vocabulary) -> None:
        self._config, self._ledger, self._vocabulary = config, ledger, vocabulary
        self._handshake_limit = handshake_limit(config)
        self._members = {op: cls.OP for op, cls in vocabulary.types.items()}
        self._buf = bytearray()
        self._eof = False
        self._header: FrameHeader | None = None
        self._meta = b""
        self._payload: bytearray | memoryview | Pieces | None = None
        self._filled = 0
        self._sinks: dict[int, memoryview | Pieces | None] = {}  # None: reserved, the buffer comes later
        self._prefill: tuple[int, int] | None = None  # (request id, bytes) of a scatter read's payload part
        self._prefilled = 0
        self._hasher: Hasher | None = None

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Buffer bytes from the peer; ``b""`` means end of stream.

        Raises UsageError after end of stream, ClosedError when poisoned/closed.
        """
        self._ledger.check_open()
        if self._eof:
            raise UsageError("data after end of stream", argument="data")
        if not data:
            self._eof = True
            return
        self._buf += data

    # ------------------------------------------------------- in-place payloads
    def expect_payload_into(self, request_id: int, buffer: object) -> None:
        """Land the DATA answer to my request ``request_id`` in ``buffer`` (exact size), or in a
        list of buffers filled in order (their total size): a vectored pull scattered in place.

        Use :meth:`payload_sink` / :meth:`payload_received` to receive straight
        into it. A DATA frame of another size raises ProtocolError(MALFORMED).
        """
        self._check_data_request(request_id)
        views = byte_views(buffer) if isinstance(buffer, (list, tuple)) else [bytes_view(buffer)]
        if not views or any(map(_READONLY, views)):
            raise UsageError("must be writable (and at least one buffer)", argument="buffer")
        self._sinks[request_id] = views[0] if len(views) == 1 else Pieces(list(filter(len, views)))

    def expect_payload_later(self, request_id: int) -> None:
        """Keep the place of my request ``request_id``'s DATA among the registered buffers, its
        buffer to come with :meth:`expect_payload_into` before that DATA is read (a pipeline that
        learns where a payload goes from an earlier answer). Until then reads stop at frame
        boundaries (:meth:`read_hint`), so no byte of that payload is buffered on the way; a DATA
        that arrives still without a buffer lands in one of its own, as an unregistered one does."""
        self._check_data_request(request_id)
        self._sinks[request_id] = None

    def _check_data_request(self, request_id: int) -> None:
        if request_id not in self._ledger.mine or Op.DATA not in self._ledger.mine[request_id]:
            raise UsageError(
                "no outstanding request answered by DATA with this id", argument="request_id", request_id=request_id
            )

    def payload_sink(self) -> memoryview | None:
        """The unfilled tail of the caller buffer being received into, or None.

        When not None, the caller may ``recv_into`` it and report the count with
        :meth:`payload_received` instead of calling :meth:`receive_data`.
        """
        if self._header is None or self._buf:
            return None
        if isinstance(self._payload, memoryview):
            return self._payload[self._filled :]
        return self._payload.tail() if isinstance(self._payload, Pieces) else None

    def payload_sinks(self) -> list[memoryview]:
        """Like :meth:`payload_sink`, every unfilled buffer of a payload landing in several (a
        vectored pull), for one scatter read; empty when there is no sink."""
        if isinstance(self._payload, Pieces) and self._header is not None and not self._buf:
            return self._payload.rest()
        sink = self.payload_sink()
        return [] if sink is None else [sink]

    def payload_received(self, n: int) -> None:
        """Record ``n`` bytes written into :meth:`payload_sink` (or across :meth:`payload_sinks`).
        Raises UsageError when out of range."""
        if isinstance(self._payload, Pieces) and self._header is not None and not self._buf:
            if self._hasher is None or not 0 < n <= self._payload.total - self._filled:
                raise UsageError("count out of range", argument="n", value=n)
            self._payload.landed(n, self._hasher)
            self._filled += n
            return
        sink, hasher = self.payload_sink(), self._hasher
        if sink is None or hasher is None or not 0 < n <= len(sink):
            raise UsageError("no payload sink or count out of range", argument="n", value=n)
        hasher.update(sink[:n])
        self._filled += n

    def read_hint(self) -> int:
        """How many bytes to read next so as not to read past a header into a payload that
        could land in a caller buffer: the rest of the current header or metadata while a
        :meth:`expect_payload_into` buffer is registered or an :meth:`expect_payload_later`
        place reserved, else 0 (any amount is fine)."""
        if not self._sinks or self._payload is not None:
            return 0
        need = (HEADER_SIZE if self._header is None else self._header.meta_len) - len(self._buf)
        return need if need > 0 else 0

    # ------------------------------------------------------------ scatter reads
    def scatter_target(self) -> memoryview | None:
        """At a frame boundary with nothing buffered: the oldest registered payload buffer (the
        next DATA most likely lands there), else None. The caller may then read one header and
        that buffer in a single scatter read and report it with :meth:`scatter_received`; bytes
        that turn out not to be that payload go back into the stream, so until its DATA has
        arrived the buffer's contents are undefined."""
        target = self._oldest_sink()
        return None if isinstance(target, Pieces) else target

    def _oldest_sink(self) -> memoryview | Pieces | None:
        """At a frame boundary with nothing buffered, the oldest registered payload sink."""
        if self._header is not None or self._buf or self._eof or not self._sinks:
            return None
        return next(iter(self._sinks.values()))

    def scatter_received(self, header: bytes | bytearray | memoryview, n: int) -> None:
        """Record a scatter read of ``n`` bytes: up to HEADER_SIZE into ``header``, the rest into
        :meth:`scatter_target` (``n == 0`` is end of stream). Raises UsageError when no target."""
        target = self._oldest_sink()
        if target is None or not 0 <= n <= HEADER_SIZE + len(target):
            raise UsageError("no scatter target or count out of range", argument="n", value=n)
        if n == 0:
            return self.receive_data(b"")
        self.receive_data(memoryview(header)[: min(n, HEADER_SIZE)])
        if n > HEADER_SIZE:
            self._prefill = (next(iter(self._sinks)), n - HEADER_SIZE)

    def _settle_prefill(self, header: FrameHeader, prefill: tuple[int, int]) -> None:
        """The frame after a scatter read is decoded: keep the bytes in place if it is the
        predicted DATA, else put them back into the stream (right after this header)."""
        rid, n = prefill
        self._prefill = None
        sink = self._sinks[rid]
        assert sink is not None  # a scatter read targets a registered buffer (_oldest_sink)
        if (
            header.op is Op.DATA
            and header.request_id == rid
            and header.meta_len == 0
            and header.payload_len == len(sink)
        ):
            self._prefilled = n
        else:
            self._buf += sink.head(n) if isinstance(sink, Pieces) else sink[:n]

    # ------------------------------------------------------- native receiver
    def data_fast_targets(self, request_ids: Sequence[int]) -> list[memoryview | list[memoryview]]:
        """The buffers of :meth:`expect_payload_into` (a buffer, or the list of a vectored pull's buffers)
        for the longest prefix of ``request_ids`` whose next frames should be their DATA answers, in this
        order, and which a caller may receive and verify itself (:meth:`data_fast_received`): READY, at a
        frame boundary with nothing buffered, TSUM64 negotiated, the ids the oldest registered ones in
        order, each size within ``max_frame_size``. Empty when none qualifies."""
        if (
            self._ledger.state is not State.READY
            or self._header is not None
            or self._buf
            or self._eof
            or self._prefill is not None
            or self._ledger.payload_algo is not _FAST_ALGO
        ):
            return []
        out: list[memoryview | list[memoryview]] = []
        for rid, (mine, sink) in zip(request_ids, self._sinks.items()):
            if rid != mine or sink is None or len(sink) > self._config.max_frame_size:
                break
            out.append(list(sink.views) if isinstance(sink, Pieces) else sink)
        return out

    def data_fast_received(self, request_id: int, payload_sum: int) -> ev.Data:
        """Record a DATA frame for ``request_id`` that the caller received into
        :meth:`data_fast_targets` and verified exactly as this parser would (every header check of
        :func:`~tiersync.net.frames.decode_header`, the request id, no metadata, the registered
        size, TSUM64 ``payload_sum`` equal to the header's); returns its event. A frame it did not
        verify goes to :meth:`scatter_received` instead. UsageError when there is no such target."""
        sink = next(iter(self.data_fast_targets((request_id,))), None)
        if sink is None:
            raise UsageError("no fast DATA target for this request", argument="request_id", request_id=request_id)
        self._ledger.check_recv(Op.DATA, request_id)
        payload = _EMPTY if isinstance(sink, list) else sink  # a vectored pull landed in the caller's buffers
        event = ev.Data(request_id, payload, (_FAST_ALGO, payload_sum))
        self._apply_recv(Op.DATA, request_id, event)
        return event

    @property
    def mid_frame(self) -> bool:
        """Whether bytes of a frame not yet complete are buffered or being received."""
        return bool(self._buf) or self._header is not None

    # ------------------------------------------------------------ the parser
    def next_event(self) -> object:
        """Return the next event, :data:`NEED_DATA`, or :class:`~tiersync.net.events.ConnectionClosed`.

        Raises ProtocolError (peer's fault; the connection is then poisoned) and
        ClosedError when poisoned. After the connection ended it keeps returning ConnectionClosed.
        """
        if self._ledger.state is State.POISONED:
            raise ClosedError("connection poisoned by an earlier protocol error")
        try:
            return self._next_event()
        except ProtocolError:
            self._ledger.state = State.POISONED
            self._buf.clear()
            self._payload = None
            raise

    def _next_event(self) -> object:
        if self._header is None:
            if len(self._buf) < HEADER_SIZE:
                return self._at_boundary()
            self._start_frame()
        header = self._header
        assert header is not None
        if len(self._buf) < header.meta_len:
            return self._need_more()
        if self._payload is None:
            self._begin_payload(header)
        self._fill_payload(header)
        if self._filled < header.payload_len:
            return self._need_more()
        return self._finish_frame(header)

    def _at_boundary(self) -> object:
        if self._ledger.state is State.CLOSED and not self._buf:
            return ev.ConnectionClosed()
        if not self._eof:
            return NEED_DATA
        if self._buf:
            raise ProtocolError("stream ended inside a frame header", fault=ProtocolFault.TRUNCATED)
        self._ledger.state = State.CLOSED
        return ev.ConnectionClosed()

    def _need_more(self) -> object:
        if self._eof:
            raise ProtocolError("stream ended inside a frame", fault=ProtocolFault.TRUNCATED)
        return NEED_DATA

    def _start_frame(self) -> None:
        header = decode_header(bytes(self._buf[:HEADER_SIZE]), self._config, self._members)
        del self._buf[:HEADER_SIZE]
        self._ledger.check_recv(header.op, header.request_id)
        if self._ledger.state is not State.READY and header.meta_len + header.payload_len > self._handshake_limit:
            raise ProtocolError(
                "handshake frame exceeds its bound",
                fault=ProtocolFault.OVERSIZE,
                meta_len=header.meta_len,
                payload_len=header.payload_len,
                limit=self._handshake_limit,
            )
        self._header = header
        if self._prefill is not None:
            self._settle_prefill(header, self._prefill)

    def _begin_payload(self, header: FrameHeader) -> None:
        meta = bytes(self._buf[: header.meta_len])
        if checksum(meta) != header.meta_checksum:
            raise ProtocolError("metadata checksum mismatch", fault=ProtocolFault.BAD_CHECKSUM)
        self._meta = meta
        del self._buf[: header.meta_len]
        if header.payload_len and header.op is not Op.DATA:
            raise ProtocolError(f"{header.op.name} carries no payload", fault=ProtocolFault.MALFORMED)
        sink = self._sinks.pop(header.request_id, None) if header.op is Op.DATA else None
        if sink is not None and len(sink) != header.payload_len:
            raise ProtocolError(
                "DATA size differs from the expected size",
                fault=ProtocolFault.MALFORMED,
                expected=len(sink),
                got=header.payload_len,
            )
        self._payload = sink if sink is not None else bytearray()
        self._filled = 0
        self._hasher = payload_hasher(header.payload_algo) if header.payload_len else None
        if self._prefilled:  # a scatter read already landed the start of this payload
            self._filled, self._prefilled = self._prefilled, 0
            assert self._hasher is not None  # a prefill lands in a registered, non-empty buffer
            if isinstance(self._payload, Pieces):
                self._payload.landed(self._filled, self._hasher)
            else:
                self._hasher.update(self._payload[: self._filled])

    def _fill_payload(self, header: FrameHeader) -> None:
        take = min(len(self._buf), header.payload_len - self._filled)
        if not take:
            return
        assert self._payload is not None and self._hasher is not None  # mid-payload: _begin_payload set both
        if isinstance(self._payload, memoryview):
            piece = self._payload[self._filled : self._filled + take]
            piece[:] = self._buf[:take]
            self._hasher.update(piece)
        elif isinstance(self._payload, Pieces):
            with memoryview(self._buf) as view:
                self._payload.fill(view[:take], self._hasher)
        else:
            with memoryview(self._buf) as view:
                self._payload += view[:take]
                self._hasher.update(view[:take])
        del self._buf[:take]
        self._filled += take

    def _finish_frame(self, header: FrameHeader) -> object:
        payload, hasher = self._payload, self._hasher
        self._header, self._payload, self._filled, self._hasher = None, None, 0, None
        assert payload is not None  # set by _begin_payload
        got = hasher.intdigest() if hasher is not None else EMPTY_CHECKSUM[header.payload_algo]
        if got != header.payload_checksum:
            raise ProtocolError("payload checksum mismatch", fault=ProtocolFault.BAD_CHECKSUM)
        event = self._parse(header, payload, got)
        self._apply_recv(header.op, header.request_id, event)
        return event

    def _parse(self, header: FrameHeader, payload: bytearray | memoryview | Pieces, payload_sum: int) -> object:
        if header.op is Op.DATA:
            if self._meta:
                raise ProtocolError("DATA carries no metadata", fault=ProtocolFault.MALFORMED)
            if isinstance(payload, Pieces):  # landed in the caller's buffers
                payload = _EMPTY
            return ev.Data(header.request_id, payload, (header.payload_algo, payload_sum))
        return self._vocabulary.parse(header.op, header.request_id, self._meta, self._config)

    def _apply_recv(self, op: enum.IntEnum, rid: int, event: object) -> None:
        if self._ledger.received(op, rid, event):
            self._sinks.pop(rid, None)
