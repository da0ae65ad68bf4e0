"""Payload buffers of one frame: byte views, checksums over several parts, and :class:`Pieces`
(a DATA payload landing in several caller buffers in order, as a vectored pull does)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, cast

from tiersync.net.frames import Hasher, PayloadChecksum, payload_checksum, payload_hasher
from tiersync.transfer import kernel

if TYPE_CHECKING:
    from typing_extensions import Buffer

_AS_BYTES = cast("Callable[[memoryview, str], memoryview]", memoryview.cast)  # unbound: map calls it per view

__all__ = ["Pieces", "byte_views", "bytes_view", "payload_views", "sum_of"]


def bytes_view(buf: object) -> memoryview:
    view = memoryview(cast("Buffer", buf))  # TypeError for anything else
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def byte_views(parts: Sequence[object]) -> list[memoryview]:
    """:func:`bytes_view` of each part, in C loops rather than a Python call per part (a
    PULL_MANY and its answer have many); TypeError for a part that is not a buffer."""
    try:
        views: Iterator[memoryview] = map(memoryview, cast("Sequence[Buffer]", parts))
        return list(map(_AS_BYTES, views, itertools.repeat("B")))
    except TypeError:  # a part cast refuses (not C-contiguous, not a buffer): bytes_view decides
        return [bytes_view(p) for p in parts]


def payload_views(payload: object) -> list[memoryview]:
    """A byte view of each non-empty part of ``payload`` (a buffer or a list of them)."""
    parts = payload if isinstance(payload, (list, tuple)) else (payload,)
    return list(filter(len, byte_views(parts)))


def sum_of(algo: PayloadChecksum, parts: list[memoryview]) -> int:
    """``algo``'s checksum of the concatenation of ``parts`` (TSUM64: one native call, the GIL
    released once for all of them, not once per part)."""
    if len(parts) == 1:
        return payload_checksum(algo, parts[0])
    if algo is PayloadChecksum.TSUM64 and kernel.TSUM64 is not None:
        return kernel.tsum64(parts)
    hasher = payload_hasher(algo)
    for part in parts:
        hasher.update(part)
    return hasher.intdigest()


class Pieces:
    """A DATA payload landing in several caller buffers, in order (a vectored pull)."""

    __slots__ = ("index", "offset", "total", "views")

    def __init__(self, views: list[memoryview]) -> None:
        self.views, self.total, self.index, self.offset = views, sum(map(len, views)), 0, 0

    def __len__(self) -> int:
        return self.total

    def tail(self) -> memoryview:
        """The unfilled rest of the current buffer."""
        return self.views[self.index][self.offset :]

    def advance(self, n: int) -> None:
        """``n`` bytes (at most :meth:`tail`'s length) landed in the current buffer."""
        self.offset += n
        if self.offset == len(self.views[self.index]) and self.index + 1 < len(self.views):
            self.index, self.offset = self.index + 1, 0

    def head(self, n: int) -> bytes:
        """The first ``n`` bytes across the buffers (a scatter read's bytes given back)."""
        out, left = bytearray(), n
        for view in self.views:
            out += view[:left]
            left = n - len(out)
            if not left:
                break
        return bytes(out)

    def rest(self) -> list[memoryview]:
        """Every unfilled buffer, the current one's tail first."""
        return [self.tail(), *self.views[self.index + 1 :]] if self.total else []

    def landed(self, n: int, hasher: Hasher) -> None:
        """``n`` bytes were received in place across :meth:`rest`: hash them, move on."""
        while n:
            tail = self.tail()
            k = min(len(tail), n)
            hasher.update(tail[:k])
            self.advance(k)
            n -= k

    def fill(self, data: memoryview, hasher: Hasher) -> None:
        """Copy ``data`` into the buffers from the current position, hashing what lands."""
        while len(data):
            tail = self.tail()
            k = min(len(tail), len(data))
            tail[:k] = data[:k]
            hasher.update(tail[:k])
            self.advance(k)
            data = data[k:]
