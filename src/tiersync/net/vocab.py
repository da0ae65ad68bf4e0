"""Vocabularies: the ops one service speaks over the one tiersync frame format.

The frame header, handshake (HELLO / CHALLENGE / AUTH / READY), ERROR, PING/PONG and the
generic payload answer DATA belong to every connection (:data:`CORE`). A service —
store nodes, prefill -> decode, weight sync — adds only its own ops: typed frozen
dataclasses with ``OP`` (a member of the service's ``IntEnum``, wire format, unique across
every vocabulary), ``meta()`` and ``parse(request_id, reader, config)``, declared as

- requests: request class -> the response classes allowed as its first answer (a response
  may allow further answers through a ``then()`` method returning op codes, or None when
  the request is finished);
- one-way messages: sent by either side in READY, never answered.

A :class:`~tiersync.net.protocol.Connection` built for a vocabulary refuses every op the
vocabulary does not name (UNKNOWN_OP), so a peer of another service is cut off at its
first frame.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tiersync.errors import UsageError
from tiersync.net.codec import MetaReader
from tiersync.net.errors import ProtocolError, ProtocolFault
from tiersync.net.frames import ProtocolConfig

__all__ = ["Vocabulary"]


@dataclass(frozen=True)
class Vocabulary:
    """The ops of one service (see the module docstring). ``include``: vocabularies merged in."""

    name: str
    requests: Mapping[type, tuple[type, ...]] = field(default_factory=dict)
    oneway: tuple[type, ...] = ()
    responses: tuple[type, ...] = ()
    include: tuple[Vocabulary, ...] = ()
    types: dict[int, type[Any]] = field(init=False, repr=False, compare=False)
    answers: dict[int, frozenset[int]] = field(init=False, repr=False, compare=False)
    response_ops: frozenset[int] = field(init=False, repr=False, compare=False)
    oneway_ops: frozenset[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        types: dict[int, type] = {}
        answers: dict[int, frozenset[int]] = {}
        responses: set[int] = set()
        oneway: set[int] = set()
        for voc in self.include:
            _merge(types, voc.types, self.name)
            answers.update(voc.answers)
            responses |= voc.response_ops
            oneway |= voc.oneway_ops
        classes = [*self.requests, *self.oneway, *self.responses, *(r for rs in self.requests.values() for r in rs)]
        _merge(types, {_op(c): c for c in classes}, self.name)
        for req, resps in self.requests.items():
            answers[_op(req)] = frozenset(_op(r) for r in resps)
            responses |= {_op(r) for r in resps}
        responses |= {_op(r) for r in self.responses}
        oneway |= {_op(c) for c in self.oneway}
        object.__setattr__(self, "types", types)
        object.__setattr__(self, "answers", answers)
        object.__setattr__(self, "response_ops", frozenset(responses))
        object.__setattr__(self, "oneway_ops", frozenset(oneway))

    @property
    def ops(self) -> frozenset[int]:
        return frozenset(self.types)

    def member(self, op: int) -> enum.IntEnum:
        """The enum member of a known raw op code (KeyError when unknown)."""
        member: enum.IntEnum = self.types[op].OP  # _op checked it is one
        return member

    def parse(self, op: int, request_id: int, meta: bytes, config: ProtocolConfig) -> object:
        """The event of a frame ``op`` with metadata ``meta`` (every byte read, fields checked).
        ProtocolError(MALFORMED) when the metadata does not parse, whatever a parser raised (a
        JSON document nested past the recursion limit, a number out of range: the peer's bytes)."""
        reader = MetaReader(meta)
        parse: Callable[[int, MetaReader, ProtocolConfig], object] = self.types[op].parse
        try:
            event = parse(request_id, reader, config)
        except ProtocolError:
            raise
        except Exception as exc:  # field checks, bad enum values, anything a peer's bytes can raise
            raise ProtocolError(
                f"invalid {self.name_of(op)} fields: {type(exc).__name__}: {str(exc)[:200]}",
                fault=ProtocolFault.MALFORMED,
            ) from exc
        reader.finish()
        return event

    def name_of(self, op: int) -> str:
        cls = self.types.get(int(op))
        return cls.OP.name if cls is not None else str(op)


def _op(cls: type) -> int:
    op = getattr(cls, "OP", None)
    if not isinstance(op, enum.IntEnum):
        raise UsageError("event classes need an OP of an IntEnum", argument="vocabulary", cls=cls.__name__)
    return int(op)


def _merge(into: dict[int, type], more: Mapping[int, type], name: str) -> None:
    for op, cls in more.items():
        if into.get(op, cls) is not cls:
            raise UsageError(
                "two event classes share an op code",
                argument="vocabulary",
                vocabulary=name,
                op=op,
                first=into[op].__name__,
                second=cls.__name__,
            )
        into[op] = cls
