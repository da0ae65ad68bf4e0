"""Sans-IO connection state machine for the tiersync wire protocol (h11 style).

Feed bytes with :meth:`Connection.receive_data`, pull events with
:meth:`Connection.next_event` (an event, or :data:`NEED_DATA`), and turn events
into bytes with :meth:`Connection.send`. The object does no I/O.

Handshake (table ``tiersync.net.states.HANDSHAKE``)::

    client: HELLO ->            <- CHALLENGE      AUTH ->          <- READY
    server: states IDLE -> MUST_CHALLENGE -> AWAIT_AUTH -> MUST_READY -> READY

In READY both sides may send requests (PING, OFFER, READ_LEASE, PULL, RELEASE)
and must answer the peer's outstanding ones (the connection's :class:`Vocabulary` says
which requests, answers and one-way messages exist); an ERROR with request id 0 ends the
connection. Errors:

- peer input that breaks the protocol -> :class:`ProtocolError`; the connection
  is then *poisoned* and every later call raises :class:`ClosedError`;
- local misuse (wrong state, unknown request id, oversize frame) ->
  :class:`UsageError`; the connection stays usable.

Memory: nothing is allocated from a peer-declared size beyond
:class:`ProtocolConfig` bounds; payload buffers grow only as bytes arrive.
Payload checksums are negotiated in the handshake (:mod:`tiersync.net.ledger`); received
payloads are verified by the algorithm their header names, incrementally as the bytes arrive.

A :class:`Connection` is the sending side plus two collaborators it builds: the
:class:`~tiersync.net.ledger.Ledger` (state, negotiated checksum, outstanding requests) and
the :class:`~tiersync.net.frame_reader.FrameReader` (the receive side, handed the ledger: the
parser, and payloads landed in place in caller buffers), which every receive method delegates to.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from tiersync.errors import UsageError
from tiersync.net import events as ev
from tiersync.net import store_ops as so
from tiersync.net.events import NEED_DATA
from tiersync.net.frame_reader import FrameReader
from tiersync.net.frames import EMPTY_CHECKSUM, Op, PayloadChecksum, ProtocolConfig, encode_header
from tiersync.net.ledger import Ledger
from tiersync.net.pieces import payload_views, sum_of
from tiersync.net.states import Role, State
from tiersync.net.vocab import Vocabulary

__all__ = ["NEED_DATA", "Connection", "Role", "State"]


class Connection:
    """One side of a framed connection. Not thread-safe; guard it with one lock.

    ``role``: which side of the handshake this is. ``config``: bounds. ``vocabulary``: the
    service's ops (default: the block store's, :data:`~tiersync.net.store_ops.STORE`).
    """

    def __init__(self, role: Role, config: ProtocolConfig | None = None, vocabulary: Vocabulary | None = None) -> None:
        if not isinstance(role, Role):
            raise UsageError("must be a Role", argument="role", value=role)
        vocabulary = vocabulary if vocabulary is not None else so.STORE
        if not isinstance(vocabulary, Vocabulary):
            raise UsageError("must be a Vocabulary", argument="vocabulary")
        self.role, self.vocabulary = role, vocabulary
        self._ledger = Ledger(role, vocabulary)
        self.config = config or ProtocolConfig()
        self._reader = FrameReader(self.config, self._ledger, vocabulary)

    # ---------------------------------------------------------------- sending
    def send(self, event: ev.Event) -> list[bytes | memoryview]:
        """Encode ``event``; returns buffers to write in order (payloads are not copied).

        Raises UsageError when the event is not allowed now (state, request id,
        size), ClosedError when the connection is closed or poisoned.
        """
        self._ledger.check_open()
        op, data = event.OP, cast(ev.Data, event)  # data: read only when op is DATA
        rid: int = getattr(event, "request_id", 0)
        self._ledger.check_send(op, rid, event)
        meta = event.meta()
        parts = payload_views(data.payload) if op is Op.DATA else []
        size = sum(map(len, parts))
        if len(meta) > self.config.max_meta_size or len(meta) + size > self.frame_limit:
            raise UsageError(
                "frame exceeds max_frame_size (this end's or the peer's)",
                argument="event",
                meta_len=len(meta),
                payload_len=size,
                limit=self.frame_limit,
            )
        self._ledger.sent(op, rid, event)
        algo = self.payload_algo
        if not size:
            return [encode_header(op, rid, meta, 0, EMPTY_CHECKSUM[algo], algo) + meta]
        known = data.payload_sum
        value = known[1] if known is not None and known[0] is algo else sum_of(algo, parts)
        return [encode_header(op, rid, meta, size, value, algo) + meta, *parts]

    # -------------------------------------------------------------- receiving
    # The receive side is the FrameReader's (tiersync.net.frame_reader); see its methods for details.
    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Buffer bytes from the peer; ``b""`` means end of stream.

        Raises UsageError after end of stream, ClosedError when poisoned/closed.
        """
        self._reader.receive_data(data)

    def next_event(self) -> object:
        """Return the next event, :data:`NEED_DATA`, or :class:`~tiersync.net.events.ConnectionClosed`.

        Raises ProtocolError (peer's fault; the connection is then poisoned) and
        ClosedError when poisoned. After the connection ended it keeps returning ConnectionClosed.
        """
        return self._reader.next_event()

    def expect_payload_into(self, request_id: int, buffer: object) -> None:
        """Land the DATA answer to my request ``request_id`` in ``buffer`` (exact size), or in a
        list of buffers filled in order (:meth:`FrameReader.expect_payload_into`)."""
        self._reader.expect_payload_into(request_id, buffer)

    def expect_payload_later(self, request_id: int) -> None:
        """Reserve the place of my request ``request_id``'s DATA buffer, registered later with
        :meth:`expect_payload_into` (:meth:`FrameReader.expect_payload_later`)."""
        self._reader.expect_payload_later(request_id)

    def payload_sink(self) -> memoryview | None:
        """The unfilled tail of the caller buffer being received into, or None
        (:meth:`FrameReader.payload_sink`)."""
        return self._reader.payload_sink()

    def payload_sinks(self) -> list[memoryview]:
        """Every unfilled buffer of the payload being received in place
        (:meth:`FrameReader.payload_sinks`)."""
        return self._reader.payload_sinks()

    def payload_received(self, n: int) -> None:
        """Record ``n`` bytes written into :meth:`payload_sink` (or across :meth:`payload_sinks`)
        (:meth:`FrameReader.payload_received`)."""
        self._reader.payload_received(n)

    def read_hint(self) -> int:
        """How many bytes to read next, 0 for any amount (:meth:`FrameReader.read_hint`)."""
        return self._reader.read_hint()

    def scatter_target(self) -> memoryview | None:
        """The payload buffer a scatter read may fill after the next header, or None
        (:meth:`FrameReader.scatter_target`)."""
        return self._reader.scatter_target()

    def scatter_received(self, header: bytes | bytearray | memoryview, n: int) -> None:
        """Record a scatter read of ``n`` bytes into ``header`` and :meth:`scatter_target`
        (:meth:`FrameReader.scatter_received`)."""
        self._reader.scatter_received(header, n)

    def data_fast_targets(self, request_ids: Sequence[int]) -> list[memoryview | list[memoryview]]:
        """The buffers a native receiver may land and verify the next DATA answers to
        ``request_ids`` in (:meth:`FrameReader.data_fast_targets`)."""
        return self._reader.data_fast_targets(request_ids)

    def data_fast_received(self, request_id: int, payload_sum: int) -> ev.Data:
        """Record a DATA frame received and verified into :meth:`data_fast_targets`; returns its
        event (:meth:`FrameReader.data_fast_received`)."""
        return self._reader.data_fast_received(request_id, payload_sum)

    @property
    def peer_checksums(self) -> tuple[int, ...]:
        """Server side: the payload checksum ids the client's HELLO offered (empty before HELLO)."""
        return self._ledger.offered if self.role is Role.SERVER else ()

    @property
    def frame_limit(self) -> int:
        """The largest frame both ends accept: this end's ``max_frame_size``, lowered to the
        peer's once its HELLO or READY stated it. :meth:`send` refuses larger frames."""
        peer = self._ledger.peer_max_frame
        return min(self.config.max_frame_size, peer) if peer else self.config.max_frame_size

    @property
    def mid_frame(self) -> bool:
        """Whether part of a frame has arrived and the rest has not (:attr:`FrameReader.mid_frame`)."""
        return self._reader.mid_frame

    @property
    def outstanding(self) -> int:
        """Requests I sent that are not yet finished."""
        return len(self._ledger.mine)

    @property
    def state(self) -> State:
        """Handshake / connection state (:class:`~tiersync.net.states.State`)."""
        return self._ledger.state

    @property
    def payload_algo(self) -> PayloadChecksum:
        """The algorithm this side sums its payloads with (XXH3_64 until negotiated)."""
        return self._ledger.payload_algo
