"""The protocol's states and its handshake table (used by :mod:`tiersync.net.protocol`).

``HANDSHAKE`` maps (role, state, direction, op) to the next state. Which responses each
request allows comes from the connection's vocabulary (:mod:`tiersync.net.vocab`; ERROR is
always allowed and final); ``then`` says which are still allowed after a given one.
"""

from __future__ import annotations

import enum

from tiersync.net.frames import Op

__all__ = ["HANDSHAKE", "Direction", "Role", "State", "then"]


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
HANDSHAKE: dict[tuple[Role, State, Direction, int], State] = {  # op: a raw code or its IntEnum member
    (Role.CLIENT, State.IDLE, _S, Op.HELLO): State.AWAIT_CHALLENGE,
    (Role.CLIENT, State.AWAIT_CHALLENGE, _R, Op.CHALLENGE): State.MUST_AUTH,
    (Role.CLIENT, State.MUST_AUTH, _S, Op.AUTH): State.AWAIT_READY,
    (Role.CLIENT, State.AWAIT_READY, _R, Op.READY): State.READY,
    (Role.SERVER, State.IDLE, _R, Op.HELLO): State.MUST_CHALLENGE,
    (Role.SERVER, State.MUST_CHALLENGE, _S, Op.CHALLENGE): State.AWAIT_AUTH,
    (Role.SERVER, State.AWAIT_AUTH, _R, Op.AUTH): State.MUST_READY,
    (Role.SERVER, State.MUST_READY, _S, Op.READY): State.READY,
}


def then(event: object) -> frozenset[int] | None:
    """Responses still allowed after response ``event`` (None: the request is finished); an
    event class allows more through a ``then()`` method (e.g. an accepted OFFER_REPLY)."""
    more = getattr(event, "then", None)
    return more() if more is not None else None
