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

from collections.abc import Callable, Sequence

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
    found = _mapped(reply, maps, peer) if reply.algo is PayloadChecksum.TSUM64 else None

    def read(rows: np.ndarray | None, mapped: local.Mapped | None) -> Sequence[int] | None:
        if rows is None:  # every region
            return local.read_summed(reply.pid, regions[:, :2], dests, threads, mapped)
        return local.read_summed(reply.pid, regions[rows, :2], [dests[i] for i in rows], threads, mapped)

    sums = _split(read, len(regions), found) if reply.algo is PayloadChecksum.TSUM64 else None
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
    found = _mapped(reply, maps, peer) if reply.algo is PayloadChecksum.TSUM64 else None

    def read(rows: np.ndarray | None, mapped: local.Mapped | None) -> Sequence[int] | None:
        if rows is None:  # every region
            return local.read_summed_at(reply.pid, regions[:, :2], dest, offsets, threads, mapped)
        return local.read_summed_at(reply.pid, regions[rows, :2], dest, offsets[rows], threads, mapped)

    sums = _split(read, len(regions), found) if reply.algo is PayloadChecksum.TSUM64 else None
    if sums is None:  # no native reader, or another algorithm: one view per region
        view = memoryview(dest.data).cast("B")
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


def _mapped(reply: ev.LocalReply, maps: SharedMaps | None, peer: str) -> tuple[local.Mapped, np.ndarray] | None:
    """A map of the memory ``reply`` names and which regions lie inside it (copied out of the
    map; the others with ``process_vm_readv``), when it names one that holds a region and
    ``maps`` can open it; else None."""
    if maps is None or reply.mapping is None or not len(reply.regions):
        return None
    _, start, nbytes, _ = reply.mapping
    regions = reply.regions
    ends = regions[:, 0] + regions[:, 1]  # uint64: a wrapped end is below its start
    if (ends < regions[:, 0]).any():
        raise ProtocolError("LOCAL_REPLY region wraps around", fault=ProtocolFault.MALFORMED, peer=peer)
    if start + nbytes >= 1 << 64:  # past the address space: a hint to ignore
        return None
    inside = (regions[:, 0] >= np.uint64(start)) & (ends <= np.uint64(start + nbytes))
    mapped = maps.map(reply.pid, reply.mapping) if inside.any() else None
    return None if mapped is None else (mapped, inside)


def _split(
    read: Callable[[np.ndarray | None, local.Mapped | None], Sequence[int] | None],
    count: int,
    found: tuple[local.Mapped, np.ndarray] | None,
) -> Sequence[int] | None:
    """Every region's sum from ``read(rows, mapped)`` (``rows`` None: all of them): the rows
    inside the map out of it, the rest with ``process_vm_readv`` (``mapped`` None); None where
    the native reader is absent."""
    if found is None or found[1].all():
        return read(None, None if found is None else found[0])
    inside = found[1]
    mapped_sums, other_sums = read(np.flatnonzero(inside), found[0]), read(np.flatnonzero(~inside), None)
    if mapped_sums is None or other_sums is None:
        return None
    sums = np.empty(count, np.uint64)
    sums[inside], sums[~inside] = mapped_sums, other_sums
    return sums.tolist()


def _verify(sums: Sequence[int], regions: np.ndarray, peer: str) -> None:
    wrong = np.flatnonzero(np.fromiter(sums, np.uint64, len(regions)) != regions[:, 2])
    if wrong.size:
        raise ProtocolError(
            "same-host copy checksum mismatch (the source changed or lied)",
            fault=ProtocolFault.BAD_CHECKSUM,
            peer=peer,
            region=int(wrong[0]),
        )
