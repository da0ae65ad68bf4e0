"""Who may send what, when: the handshake and request bookkeeping of one connection.

A :class:`Ledger` is the part of :class:`~tiersync.net.protocol.Connection` that knows no bytes:
the state (``tiersync.net.states.HANDSHAKE`` until READY), the payload checksum negotiated in the
handshake, and two tables of outstanding requests — the ones this side sent (which answers it
may receive) and the peer's (which answers this side may send). ``check_*`` refuse an op without
changing anything (local misuse is :class:`UsageError`, a peer's is :class:`ProtocolError`);
``sent`` / ``received`` apply an op that passed its check.

Payload checksums (see :mod:`tiersync.net.frames`): the client's HELLO offers ids (each one
this build verifies, else UsageError), the server's CHALLENGE picks one of them (else
UsageError; a client receiving a pick it did not offer raises ProtocolError), and from then on
:attr:`Ledger.payload_algo` sums what this side sends.
"""

from __future__ import annotations

import enum
from typing import cast

from tiersync.errors import ClosedError, UsageError
from tiersync.net.errors import ProtocolError, ProtocolFault
from tiersync.net.events import Challenge, Hello, Ready
from tiersync.net.frames import MIN_FRAME_SIZE, SUPPORTED, Op, PayloadChecksum
from tiersync.net.states import HANDSHAKE, Direction, Role, State, then
from tiersync.net.vocab import Vocabulary

__all__ = ["Ledger"]

_S, _R = Direction.SEND, Direction.RECV
_LOCAL = frozenset(int(a) for a in SUPPORTED)


class Ledger:
    """Handshake state, negotiated checksum and outstanding requests of one connection side."""

    def __init__(self, role: Role, vocabulary: Vocabulary) -> None:
        self.role, self.vocabulary = role, vocabulary
        self._answers, self._responses = vocabulary.answers, vocabulary.response_ops
        self._oneway, self.types = vocabulary.oneway_ops, vocabulary.types
        self.state = State.IDLE
        self.mine: dict[int, frozenset[int]] = {}  # requests I sent -> responses I may receive
        self._theirs: dict[int, frozenset[int]] = {}  # requests I received -> responses I may send
        self.offered: tuple[int, ...] = ()  # payload checksum ids offered in HELLO
        self.peer_max_frame = 0  # the largest frame the peer accepts, from its HELLO or READY (0: not stated)
        self.payload_algo = PayloadChecksum.XXH3_64
        """The algorithm this side sums its payloads with (XXH3_64 until negotiated)."""

    def check_open(self) -> None:
        """ClosedError once the connection is poisoned or closed."""
        if self.state is State.POISONED:
            raise ClosedError("connection poisoned by an earlier protocol error")
        if self.state is State.CLOSED:
            raise ClosedError("connection closed")

    # ---------------------------------------------------------------- sending
    def check_send(self, op: enum.IntEnum, rid: int, event: object) -> None:
        """UsageError when this side may not send ``op`` for request ``rid`` now."""
        if self.state is not State.READY:
            if op is Op.ERROR:
                return
            if (self.role, self.state, _S, op) in HANDSHAKE:
                return self._check_checksums(op, event)
            raise UsageError(f"cannot send {op.name} in state {self.state.value}", argument="event")
        if op not in self.types:
            raise UsageError(f"{op.name} is not in the {self.vocabulary.name} vocabulary", argument="event")
        if op in self._answers:
            if rid == 0 or rid in self.mine:
                raise UsageError("request id must be nonzero and not outstanding", argument="event", request_id=rid)
        elif op in self._oneway:
            return
        elif op in self._responses:
            if op is Op.ERROR and rid == 0:
                return
            if op not in self._theirs.get(rid, ()) and not (op is Op.ERROR and rid in self._theirs):
                raise UsageError(f"no outstanding peer request {rid} answerable by {op.name}", argument="event")
        else:
            raise UsageError(f"cannot send {op.name} after the handshake", argument="event")

    def _check_checksums(self, op: enum.IntEnum, event: object) -> None:
        if op is Op.HELLO and any(c not in _LOCAL for c in cast(Hello, event).checksums):
            raise UsageError(
                "HELLO may offer only payload checksums this build verifies",
                argument="event",
                offered=cast(Hello, event).checksums,
                supported=sorted(_LOCAL),
            )
        if op is Op.CHALLENGE:
            picked = cast(Challenge, event).checksum
            if picked not in self.offered or picked not in SUPPORTED:
                raise UsageError(
                    "CHALLENGE must pick a payload checksum the client offered and this build has",
                    argument="event",
                    offered=self.offered,
                    picked=picked.name,
                )

    def sent(self, op: enum.IntEnum, rid: int, event: object) -> None:
        """Apply an op :meth:`check_send` allowed."""
        if op is Op.ERROR and (rid == 0 or self.state is not State.READY):
            self.state = State.CLOSED
        elif self.state is not State.READY:
            self.state = HANDSHAKE[(self.role, self.state, _S, op)]
            if op is Op.HELLO:
                self.offered = cast(Hello, event).checksums
            elif op is Op.CHALLENGE:
                self.payload_algo = cast(Challenge, event).checksum
        elif op in self._answers:
            self.mine[rid] = self._answers[op]
        elif op not in self._oneway:
            _advance(self._theirs, rid, event)

    # -------------------------------------------------------------- receiving
    def check_recv(self, op: enum.IntEnum, rid: int) -> None:
        """ProtocolError(UNEXPECTED) when the peer may not send ``op`` for ``rid`` now."""
        if self.state is State.CLOSED:
            raise ProtocolError("frame after the connection ended", fault=ProtocolFault.UNEXPECTED)
        if self.state is not State.READY:
            if op is Op.ERROR or (self.role, self.state, _R, op) in HANDSHAKE:
                return
        elif op in self._answers:
            if rid != 0 and rid not in self._theirs:
                return
        elif (
            op in self._oneway
            or (op is Op.ERROR and (rid == 0 or rid in self.mine))
            or (op in self._responses and op in self.mine.get(rid, ()))
        ):
            return
        raise ProtocolError(
            f"unexpected {op.name} in state {self.state.value}", fault=ProtocolFault.UNEXPECTED, request_id=rid
        )

    def received(self, op: enum.IntEnum, rid: int, event: object) -> bool:
        """Apply an op :meth:`check_recv` allowed; True when it answered one of my requests."""
        if op is Op.ERROR and (rid == 0 or self.state is not State.READY):
            self.state = State.CLOSED
        elif self.state is not State.READY:
            self.state = HANDSHAKE[(self.role, self.state, _R, op)]
            self._negotiate(op, event)
        elif op in self._answers:
            self._theirs[rid] = self._answers[op]
        elif op not in self._oneway:
            _advance(self.mine, rid, event)
            return True
        return False

    def _negotiate(self, op: enum.IntEnum, event: object) -> None:
        if op in (Op.HELLO, Op.READY):
            limit = cast("Hello | Ready", event).max_frame
            if 0 < limit < MIN_FRAME_SIZE:  # each pull would be cut into countless tiny ones
                raise ProtocolError(
                    "peer's max_frame_size is below the least accepted",
                    fault=ProtocolFault.MALFORMED,
                    max_frame=limit,
                    least=MIN_FRAME_SIZE,
                )
            self.peer_max_frame = limit
        if op is Op.HELLO:
            self.offered = cast(Hello, event).checksums
        elif op is Op.CHALLENGE:
            picked = cast(Challenge, event).checksum
            if picked not in self.offered:
                raise ProtocolError(
                    "server picked a payload checksum the client did not offer",
                    fault=ProtocolFault.MALFORMED,
                    picked=picked.name,
                    offered=self.offered,
                )
            self.payload_algo = picked


def _advance(table: dict[int, frozenset[int]], rid: int, event: object) -> None:
    nxt = then(event)
    if nxt is None:
        del table[rid]
    else:
        table[rid] = nxt
