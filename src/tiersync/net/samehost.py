"""Same-host reads with the wire's guarantees: copy what a LOCAL_REPLY points at, verified.

A same-host source answers PULL_LOCAL with where each range lives in its memory and the
range's checksum (by the connection's negotiated algorithm); the bytes stay put while the
reader's lease holds. :func:`local_copy` copies them with ``process_vm_readv`` (kernel copies,
GIL released, :mod:`tiersync.net.local`), or out of a map of the source's memory where the
reply names a sealed memfd that holds them and this process may map it
(:class:`~tiersync.net.shared_maps.SharedMaps`; copied and summed in one pass), on a few
threads, summing each piece while it is still in cache, so a range that changed or was
mis-described is refused exactly as a DATA frame with a bad checksum would be: nothing
unverified is ever reported as landed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tiersync.net import events as ev
from tiersync.net import local
from tiersync.net.errors import ProtocolError, ProtocolFault
from tiersync.net.frames import PayloadChecksum, payload_checksum
from tiersync.net.shared_maps import SharedMaps

__all__ = ["local_copy", "local_copy_at"]


def local_copy(
    reply: object,
    dests: Sequence[memoryview],
    peer: str,
    threads: int = 1,
    maps: SharedMaps | None = None,
    pid: int | None = None,
) -> None:
    """Copy ``reply``'s regions of its process into ``dests`` (one per region, exact sizes) on
    up to ``threads`` threads and verify each region's checksum; out of ``maps`` where the
    reply names a mapping they can open. ``pid``: the server's, which the reply must name.
    ProtocolError (UNEXPECTED / MALFORMED / BAD_CHECKSUM) naming ``peer``; LocalReadError when
    this process may not read the source (the caller may fall back)."""
    reply = _check(reply, peer, pid)
    regions = reply.regions
    if len(regions) != len(dests) or not np.array_equal(
        regions[:, 1], np.fromiter(map(len, dests), np.uint64, len(dests))
    ):
        raise ProtocolError("LOCAL_REPLY regions do not match the request", fault=ProtocolFault.MALFORMED, peer=peer)
    sums = (
        local.read_summed(reply.pid, regions[:, :2], dests, threads, _mapped(reply, maps, peer))
        if reply.algo is PayloadChecksum.TSUM64
        else None
    )
    if sums is None:  # no native reader, or another algorithm: copy, then a second pass
        local.read_remote(reply.pid, regions[:, :2], dests)
        sums = [payload_checksum(reply.algo, d) for d in dests]
    _verify(sums, regions, peer)


def local_copy_at(
    reply: object,
    dest: np.ndarray,
    offsets: np.ndarray,
    peer: str,
    threads: int = 1,
    maps: SharedMaps | None = None,
    pid: int | None = None,
) -> None:
    """:func:`local_copy` into one writable uint8 array, region ``i`` at ``dest[offsets[i]:]``
    (the caller placed the regions): no Python object per region. Raises as :func:`local_copy`."""
    reply = _check(reply, peer, pid)
    regions = reply.regions
    if len(regions) != len(offsets):
        raise ProtocolError("LOCAL_REPLY regions do not match the request", fault=ProtocolFault.MALFORMED, peer=peer)
    if (
        reply.algo is not PayloadChecksum.TSUM64
        or (sums := local.read_summed_at(reply.pid, regions[:, :2], dest, offsets, threads, _mapped(reply, maps, peer)))
        is None
    ):
        view = memoryview(dest.data).cast("B")  # no native reader, or another algorithm: one view per region
        lengths = regions[:, 1].tolist()
        return local_copy(reply, [view[o : o + n] for o, n in zip(offsets.tolist(), lengths)], peer, threads, maps, pid)
    _verify(sums, regions, peer)
    return None


def _check(reply: object, peer: str, pid: int | None) -> ev.LocalReply:
    if not isinstance(reply, ev.LocalReply):
        raise ProtocolError("expected LOCAL_REPLY", fault=ProtocolFault.UNEXPECTED, peer=peer)
    if pid is not None and reply.pid != pid:  # another process than the one checked to be the server
        raise ProtocolError("LOCAL_REPLY names another process", fault=ProtocolFault.MALFORMED, peer=peer)
    return reply


def _mapped(reply: ev.LocalReply, maps: SharedMaps | None, peer: str) -> local.Mapped | None:
    """A map of the memory ``reply`` names, when it names one, every region lies inside it and
    ``maps`` can open it; else None (``process_vm_readv``)."""
    if maps is None or reply.mapping is None or not len(reply.regions):
        return None
    _, start, nbytes = reply.mapping
    regions = reply.regions
    ends = regions[:, 0] + regions[:, 1]  # uint64: a wrapped end is below its start
    if int(regions[:, 0].min()) < start or (ends < regions[:, 0]).any() or int(ends.max()) > start + nbytes:
        raise ProtocolError("LOCAL_REPLY region outside its mapping", fault=ProtocolFault.MALFORMED, peer=peer)
    return maps.map(reply.pid, reply.mapping)


def _verify(sums: Sequence[int], regions: np.ndarray, peer: str) -> None:
    wrong = np.flatnonzero(np.fromiter(sums, np.uint64, len(regions)) != regions[:, 2])
    if wrong.size:
        raise ProtocolError(
            "same-host copy checksum mismatch (the source changed or lied)",
            fault=ProtocolFault.BAD_CHECKSUM,
            peer=peer,
            region=int(wrong[0]),
        )
