"""The protocol's states and its transition tables (used by :mod:`tiersync.net.protocol`).

``HANDSHAKE`` maps (role, state, direction, op) to the next state; ``ANSWERS`` names the
responses each request op allows first (ERROR is always allowed and final); ``then`` says
which responses are still allowed after a given one.
"""
from __future__ import annotations

import enum

from tiersync.net import events as ev
from tiersync.net.frames import Op

__all__ = ["ANSWERS", "HANDSHAKE", "RESPONSES", "Direction", "Role", "State", "then"]


class Role(enum.Enum):
    CLIENT = "client"
    SERVER = "server"


class State(enum.Enum):
    IDLE = "idle"
    AWAIT_CHALLENGE = "await_challenge"
    MUST_AUTH = "must_auth"
    AWAIT_READY = "await_ready"
    MUST_CHALLENGE = "must_challenge"
    AWAIT_AUTH = "await_auth"
    MUST_READY = "must_ready"
    READY = "ready"
    CLOSED = "closed"
    POISONED = "poisoned"


class Direction(enum.Enum):
    SEND = "send"
    RECV = "recv"


_S, _R = Direction.SEND, Direction.RECV  # table shorthand
HANDSHAKE: dict[tuple[Role, State, Direction, Op], State] = {
    (Role.CLIENT, State.IDLE, _S, Op.HELLO): State.AWAIT_CHALLENGE,
    (Role.CLIENT, State.AWAIT_CHALLENGE, _R, Op.CHALLENGE): State.MUST_AUTH,
    (Role.CLIENT, State.MUST_AUTH, _S, Op.AUTH): State.AWAIT_READY,
    (Role.CLIENT, State.AWAIT_READY, _R, Op.READY): State.READY,
    (Role.SERVER, State.IDLE, _R, Op.HELLO): State.MUST_CHALLENGE,
    (Role.SERVER, State.MUST_CHALLENGE, _S, Op.CHALLENGE): State.AWAIT_AUTH,
    (Role.SERVER, State.AWAIT_AUTH, _R, Op.AUTH): State.MUST_READY,
    (Role.SERVER, State.MUST_READY, _S, Op.READY): State.READY,
}

# Request op -> response ops allowed first (ERROR is always allowed and final).
ANSWERS: dict[Op, frozenset[Op]] = {
    Op.PING: frozenset({Op.PONG}),
    Op.OFFER: frozenset({Op.OFFER_REPLY}),
    Op.READ_LEASE: frozenset({Op.LEASE_REPLY}),
    Op.PULL: frozenset({Op.DATA}),
    Op.RELEASE: frozenset({Op.COMMIT_REPLY}),
}
RESPONSES = frozenset({Op.PONG, Op.OFFER_REPLY, Op.LEASE_REPLY, Op.DATA, Op.COMMIT_REPLY, Op.ERROR})


def then(event: object) -> frozenset[Op] | None:
    """Responses still allowed after ``event`` (None: the request is finished)."""
    if isinstance(event, ev.OfferReply) and event.status in (ev.OfferStatus.ACCEPT, ev.OfferStatus.PARTIAL_EXIST):
        return frozenset({Op.COMMIT_REPLY})
    return None
