"""What a decode rank asks of a prefill rank (:class:`ReadRequest`), built and validated (never trusted).

It travels as the JSON metadata of a ``KV_OPEN`` (:mod:`tiersync.disagg.ops`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tiersync.disagg.geometry import PagedKVLayout
from tiersync.errors import UsageError
from tiersync.net.errors import ProtocolError, ProtocolFault

__all__ = ["ReadRequest", "check_request_id", "parse_read"]

MAX_REQUEST_ID = 256


def check_request_id(value: Any, argument: str = "request_id") -> str:
    """Request ids are non-empty str of at most 256 characters. Raises UsageError."""
    if not isinstance(value, str) or not value or len(value) > MAX_REQUEST_ID:
        raise UsageError(
            f"must be a non-empty str of at most {MAX_REQUEST_ID} characters", argument=argument, value=value
        )
    return value


@dataclass(frozen=True, slots=True)
class ReadRequest:
    """What a decode rank asks of one prefill rank for one request.

    ``src_layout``: the prefill layout the decode rank planned its reads with (from the
    request's source description): a prefill rank whose layout is another refuses the read,
    since the bytes would land where the reader's plan, not its own, puts them.
    ``notify_only``: the decode rank reads nothing from this source (an unused replica) and
    only tells it that no reader will come, so it can finish.
    """

    request_id: str
    src_rank: int
    dst_rank: int
    dst_layout: PagedKVLayout
    dst_block_ids: tuple[int, ...]
    src_block_ids: tuple[int, ...]
    num_tokens: int
    src_layout: PagedKVLayout
    notify_only: bool = False

    def to_meta(self) -> dict[str, object]:
        return {
            "request_id": self.request_id,
            "src_rank": self.src_rank,
            "dst_rank": self.dst_rank,
            "dst_layout": self.dst_layout.to_dict(),
            "dst_block_ids": list(self.dst_block_ids),
            "src_block_ids": list(self.src_block_ids),
            "num_tokens": self.num_tokens,
            "src_layout": self.src_layout.to_dict(),
            "notify_only": self.notify_only,
        }


def _bad(message: str, **context: Any) -> ProtocolError:
    return ProtocolError(message, fault=ProtocolFault.MALFORMED, **context)


def _int(meta: Mapping[str, object], name: str, minimum: int = 0) -> int:
    value = meta.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise _bad(f"{name} must be an int >= {minimum}", field=name)
    return value


def _ids(meta: Mapping[str, object], name: str) -> tuple[int, ...]:
    value = meta.get(name)
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise _bad(f"{name} must be a list of ints", field=name)
    return tuple(value)


def parse_read(meta: Mapping[str, object]) -> ReadRequest:
    """Validate a READ's metadata. Raises ProtocolError (MALFORMED) naming the field."""
    try:
        request_id = check_request_id(meta.get("request_id"))
        layout = PagedKVLayout.from_dict(meta.get("dst_layout"), argument="dst_layout")
        src_layout = PagedKVLayout.from_dict(meta.get("src_layout"), argument="src_layout")
    except UsageError as exc:
        raise _bad(exc.message) from None
    notify = meta.get("notify_only")
    if not isinstance(notify, bool):
        raise _bad("notify_only must be a bool", field="notify_only")
    return ReadRequest(
        request_id,
        _int(meta, "src_rank"),
        _int(meta, "dst_rank"),
        layout,
        _ids(meta, "dst_block_ids"),
        _ids(meta, "src_block_ids"),
        _int(meta, "num_tokens", 1),
        src_layout,
        notify,
    )
