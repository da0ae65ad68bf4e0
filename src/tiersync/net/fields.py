"""The protocol's status enums and the field checks its events run when constructed.

Enum values travel as u8 and are wire format: never renumber. Each check raises
:class:`~tiersync.errors.UsageError` naming the field.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import operator
from typing import Any, TypeVar, cast

from tiersync.errors import UsageError
from tiersync.net.codec import KEY_SIZE

T = TypeVar("T")

__all__ = [
    "CommitStatus",
    "ErrorCode",
    "LeaseStatus",
    "OfferStatus",
    "check_bytes",
    "check_enum",
    "check_keys",
    "check_text",
    "check_u64",
    "check_u64s",
    "parsed",
]

_U64_MAX = (1 << 64) - 1


class ErrorCode(enum.IntEnum):
    INTERNAL = 1
    BAD_REQUEST = 2
    AUTH_FAILED = 3
    NOT_FOUND = 4
    LEASE_EXPIRED = 5
    CAPACITY = 6
    UNSUPPORTED = 7
    SHUTTING_DOWN = 8


class OfferStatus(enum.IntEnum):
    """Answer to an OFFER. ACCEPT / PARTIAL_EXIST are followed by a COMMIT_REPLY."""

    ACCEPT = 1
    PARTIAL_EXIST = 2
    ALL_EXIST = 3
    REFUSED = 4


class LeaseStatus(enum.IntEnum):
    GRANTED = 1
    MISSING = 2


class CommitStatus(enum.IntEnum):
    COMMITTED = 1
    FAILED = 2


def check_u64(name: str, v: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= _U64_MAX:
        raise UsageError("must be an int in [0, 2**64)", argument=name, value=v)


def check_u32(name: str, v: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 1 << 32:
        raise UsageError("must be an int in [0, 2**32)", argument=name, value=v)


def check_bytes(name: str, v: object, sizes: tuple[int, ...]) -> None:
    if not isinstance(v, bytes) or len(v) not in sizes:
        raise UsageError(f"must be bytes of length {sizes}", argument=name)


def check_keys(name: str, keys: object) -> None:
    if not isinstance(keys, tuple) or any(not isinstance(k, bytes) or len(k) != KEY_SIZE for k in keys):
        raise UsageError("must be a tuple of 16-byte keys", argument=name)


def check_u64s(name: str, values: object) -> None:
    if not isinstance(values, tuple):
        raise UsageError("must be a tuple of ints", argument=name)
    for v in values:
        check_u64(name, v)


def check_rows(name: str, rows: object, kinds: tuple[type, ...]) -> None:
    """``rows``: a tuple of tuples shaped like ``kinds`` (``int`` fields in [0, 2**64), ``bytes``
    fields any length, checked by the caller), one C loop per column instead of a Python step
    per field."""
    if not isinstance(rows, tuple) or set(map(type, rows)) - {tuple} or set(map(len, rows)) - {len(kinds)}:
        raise UsageError(f"must be a tuple of {len(kinds)}-tuples", argument=name)
    for i, kind in enumerate(kinds):
        column = list(map(operator.itemgetter(i), rows))
        if set(map(type, column)) - {kind}:
            raise UsageError(f"field {i} must be {kind.__name__}", argument=name)
        if kind is int and column and (min(column) < 0 or max(column) > _U64_MAX):
            raise UsageError(f"field {i} must be in [0, 2**64)", argument=name)


def parsed(cls: type[T], *values: object) -> T:
    """An event of the dataclass ``cls`` from ``values`` (its fields, in order) that a parser
    already bounded, its struct formats fixing each field's type and range: built without
    ``__post_init__``, whose checks would cost a Python call per item of every many-item
    request a server reads. TypeError (a bug, not a peer's fault) when the count differs."""
    names = _field_names(cast(Any, cls))
    if len(values) != len(names):
        raise TypeError(f"{cls.__name__} has {len(names)} fields, got {len(values)} values")
    event = object.__new__(cls)
    for name, value in zip(names, values):
        object.__setattr__(event, name, value)
    return event


@functools.cache
def _field_names(cls: Any) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def check_enum(name: str, v: object, kind: type[enum.IntEnum]) -> None:
    if not isinstance(v, kind):
        raise UsageError(f"must be a {kind.__name__}", argument=name, value=v)


def check_text(name: str, v: object) -> None:
    if not isinstance(v, str):
        raise UsageError("must be a str", argument=name)
