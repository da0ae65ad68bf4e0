"""Same-host reads with the wire's guarantees: copy what a LOCAL_REPLY points at, verified.

A same-host source answers PULL_LOCAL with where each range lives in its memory and the
range's checksum (by the connection's negotiated algorithm); the bytes stay put while the
reader's lease holds. :func:`local_copy` copies them with ``process_vm_readv`` (one kernel
copy, GIL released, :mod:`tiersync.net.local`) in pieces, and sums each piece while it is
still in cache, so a range that changed or was mis-described is refused exactly as a DATA
frame with a bad checksum would be: nothing unverified is ever reported as landed.
"""
from __future__ import annotations

from typing import Sequence

from tiersync.net import events as ev
from tiersync.net import local
from tiersync.net.errors import ProtocolError, ProtocolFault
from tiersync.net.frames import payload_hasher

__all__ = ["local_copy"]

_PIECE = 4 << 20  # bytes copied before they are summed (the next piece is copied meanwhile)


def local_copy(reply: ev.LocalReply, dests: Sequence[memoryview], peer: str) -> None:
    """Copy ``reply``'s regions of its process into ``dests`` (one per region, exact sizes) and
    verify each region's checksum. ProtocolError (MALFORMED / BAD_CHECKSUM) naming ``peer``;
    LocalReadError when this process may not read the source (the caller may fall back)."""
    if not isinstance(reply, ev.LocalReply):
        raise ProtocolError("expected LOCAL_REPLY", fault=ProtocolFault.UNEXPECTED, peer=peer)
    if len(reply.regions) != len(dests) or any(r[1] != len(d) for r, d in zip(reply.regions, dests)):
        raise ProtocolError("LOCAL_REPLY regions do not match the request", fault=ProtocolFault.MALFORMED, peer=peer)
    check = _Verifier(reply, dests, peer)
    local.read_remote_chunks(reply.pid, [(addr, n) for addr, n, _ in reply.regions], list(dests), piece=_PIECE,
                             on_piece=check.piece)
    check.finish()


class _Verifier:
    """Sums landed pieces region by region (pieces arrive in destination order, each inside
    one destination) and compares each region's sum once it is complete."""

    def __init__(self, reply: ev.LocalReply, dests: Sequence[memoryview], peer: str) -> None:
        self._sums = [r[2] for r in reply.regions]
        self._left = [len(d) for d in dests]
        self._algo, self._peer = reply.algo, peer
        self._i = 0
        self._hasher = payload_hasher(self._algo)
        self._skip_empty()

    def piece(self, view: memoryview) -> None:
        self._hasher.update(view)
        self._left[self._i] -= len(view)
        if self._left[self._i] < 0:
            raise ProtocolError("same-host copy overran a region", fault=ProtocolFault.MALFORMED, peer=self._peer)
        if self._left[self._i] == 0:
            self._close_region()

    def _close_region(self) -> None:
        if self._hasher.intdigest() != self._sums[self._i]:
            raise ProtocolError("same-host copy checksum mismatch (the source changed or lied)",
                                fault=ProtocolFault.BAD_CHECKSUM, peer=self._peer, region=self._i)
        self._i += 1
        self._hasher = payload_hasher(self._algo)
        self._skip_empty()

    def _skip_empty(self) -> None:
        while self._i < len(self._left) and self._left[self._i] == 0:
            self._close_region()

    def finish(self) -> None:
        if self._i != len(self._left):
            raise ProtocolError("same-host copy ended early", fault=ProtocolFault.TRUNCATED, peer=self._peer)
