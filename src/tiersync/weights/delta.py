"""Delta syncs: a sampler fetches only the chunks whose bytes changed since what it holds.

The chunks are the plan's (:mod:`tiersync.weights.planner`: source box x destination box, cut
to ``PublisherConfig.segment_bytes``); a chunk's identity is ``(tensor, global box start)``.
Per version the sampler asks every trainer shard (``W_SUMS``) for the payload checksum of the
chunks it pushes, the same sums a GET's DATA carries (one hash per chunk and version on the
trainer). :class:`DeltaState` remembers, per buffer set, the checksum of every chunk that set
holds, verified. Each chunk of a new version is then

- *kept*: the set being written already holds those bytes (its older version had them);
- *copied*: the active set (double-buffered) holds them: a local copy, nothing fetched;
- *fetched*: shared memory, TCP or relay, as in a full sync.

After landing, every kept, copied and relayed chunk is hashed and compared with the trainer's
checksum (direct TCP GETs are verified by the wire against that very checksum); a mismatch is
fetched again straight from the trainer shard and checked once more, IntegrityError when it
still differs: wrong bytes are never committed. A set whose sync began but did not commit
holds nothing known (its next sync fetches every chunk it cannot copy).
With one buffer set the new version overwrites the live one: unchanged chunks stay in place
(kept, verified) and a failed sync forgets the set's checksums, so the next one is full.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, cast

import numpy as np

from tiersync.errors import IntegrityError, UsageError
from tiersync.net.frames import SUPPORTED, PayloadChecksum, payload_checksum
from tiersync.weights.config import TransportKind
from tiersync.weights.executor import span_view
from tiersync.weights.fetch import Job, TcpPool
from tiersync.weights.ops import SumsReply
from tiersync.weights.spans import StridedSpan

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["DeltaState", "Landing", "chunk_sum"]

ChunkKey = tuple[str, tuple[int, ...]]
_BATCH = 1 << 16  # spans per W_SUMS (the op's bound)
_SPAN_META = 24  # bytes of one span in a W_SUMS besides 16 per dimension


def chunk_sum(algo: PayloadChecksum, arr: np.ndarray, span: StridedSpan) -> int:
    """Checksum of ``span``'s bytes of ``arr`` in C order (what the trainer computed for them)."""
    # numpy arrays export the buffer protocol; its stubs do not say so (hence the casts)
    if span.is_contiguous:
        flat = arr.reshape(-1).view(np.uint8)
        return payload_checksum(algo, memoryview(cast("Buffer", flat[span.offset : span.offset + span.nbytes])))
    return payload_checksum(algo, memoryview(cast("Buffer", np.ascontiguousarray(span_view(arr, span)).reshape(-1))))


def _key(job: Job) -> ChunkKey:
    return job.tensor, tuple(job.key)


def _origin_span(job: Job) -> StridedSpan:
    """The chunk in its trainer shard's buffer (what a W_SUMS asks for; build_jobs sets it)."""
    if job.origin_span is None:
        raise UsageError("a delta sync needs every job's origin_span", argument="jobs", tensor=job.tensor)
    return job.origin_span


@dataclass(frozen=True, slots=True)
class Landing:
    """What one sync did: bytes ``moved`` (fetched: shm, tcp, relay; refetches included),
    ``copied`` (from the active set), ``kept`` (already in place) and ``refetched`` (chunks whose
    local bytes failed the check)."""

    moved: int = 0
    copied: int = 0
    kept: int = 0
    refetched: int = 0


class DeltaState:
    """Per buffer set, the verified checksum of every chunk it holds; thread-safe."""

    def __init__(self, sets: int, pool: TcpPool, max_meta_bytes: int) -> None:
        self._held: list[dict[ChunkKey, int]] = [{} for _ in range(sets)]
        self._algo: list[PayloadChecksum | None] = [None] * sets
        self._pool, self._max_meta = pool, max_meta_bytes
        self._lock = threading.Lock()

    def begin(self, index: int) -> tuple[PayloadChecksum | None, dict[ChunkKey, int]]:
        """Set ``index`` is about to be written: what it held (forgotten until :meth:`commit`)."""
        with self._lock:
            out = self._algo[index], self._held[index]
            self._held[index], self._algo[index] = {}, None
            return out

    def held(self, index: int) -> tuple[PayloadChecksum | None, dict[ChunkKey, int]]:
        with self._lock:
            return self._algo[index], self._held[index]

    def commit(self, index: int, algo: PayloadChecksum, sums: Mapping[ChunkKey, int]) -> None:
        with self._lock:
            self._held[index], self._algo[index] = dict(sums), algo

    def sums(
        self, version: int, jobs: list[Job], addresses: Mapping[int, str]
    ) -> tuple[PayloadChecksum, dict[ChunkKey, int]] | None:
        """The trainer's checksum of every job's chunk (W_SUMS per trainer shard and tensor, in
        parallel); None when they are of an algorithm this build cannot compute."""
        groups: dict[tuple[int, str], list[Job]] = {}
        for j in jobs:
            groups.setdefault((j.origin, j.tensor), []).append(j)
        batches = []
        for (origin, tensor), group in groups.items():  # each W_SUMS well inside max_meta_bytes
            size = _SPAN_META + 16 * max(len(_origin_span(j).counts) for j in group)
            step = max(1, min(_BATCH, (self._max_meta // 2 - len(tensor)) // size))
            batches += [(origin, tensor, group[i : i + step]) for i in range(0, len(group), step)]

        def ask(batch: tuple[int, str, list[Job]]) -> tuple[list[Job], SumsReply]:
            origin, tensor, group = batch
            spans = tuple(_origin_span(j) for j in group)
            incarnation = group[0].sources[-1].incarnation  # the last source is the trainer shard itself
            return group, self._pool.sums(addresses[origin], version, incarnation, tensor, spans)

        with ThreadPoolExecutor(min(16, max(1, len(batches))), thread_name_prefix="sums") as pool:
            replies = list(pool.map(ask, batches))
        algos = {r.algo for _, r in replies}
        if len(algos) != 1 or next(iter(algos)) not in {int(a) for a in SUPPORTED}:
            return None
        out = {_key(j): s for group, r in replies for j, s in zip(group, r.sums)}
        return PayloadChecksum(algos.pop()), out


def triage(
    jobs: list[Job], want: Mapping[ChunkKey, int], here: Mapping[ChunkKey, int], active: Mapping[ChunkKey, int]
) -> tuple[list[Job], list[Job], list[Job]]:
    """``(kept, copied, fetched)``: in place already, in the active set, or neither."""
    kept, copied, fetched = [], [], []
    for j in jobs:
        k = _key(j)
        if here.get(k) == want[k]:
            kept.append(j)
        elif active.get(k) == want[k]:
            copied.append(j)
        else:
            fetched.append(j)
    return kept, copied, fetched


def copy_local(jobs: list[Job], src: Mapping[str, np.ndarray], dst: Mapping[str, np.ndarray]) -> None:
    """Copy each job's chunk from the active set ``src`` to the set being written ``dst``."""
    for j in jobs:
        np.copyto(span_view(dst[j.tensor], j.dst_span), span_view(src[j.tensor], j.dst_span))


def bad_chunks(
    algo: PayloadChecksum, jobs: list[Job], bufs: Mapping[str, np.ndarray], want: Mapping[ChunkKey, int]
) -> list[Job]:
    """The jobs whose landed bytes do not have the trainer's checksum."""
    return [j for j in jobs if chunk_sum(algo, bufs[j.tensor], j.dst_span) != want[_key(j)]]


def direct(job: Job) -> Job:
    """``job`` fetched from its trainer shard only (shared memory or a direct GET), no relay."""
    return replace(job, sources=job.sources[-1:], stage=0)


def land_delta(
    algo: PayloadChecksum,
    want: Mapping[ChunkKey, int],
    jobs: list[Job],
    bufs: Mapping[str, np.ndarray],
    here: Mapping[ChunkKey, int],
    active: tuple[Mapping[ChunkKey, int], Mapping[str, np.ndarray]] | None,
    fetch: Callable[[list[Job]], None],
    landed: Callable[[list[Job]], None],
) -> Landing:
    """Land ``jobs`` in ``bufs``: keep, copy or ``fetch`` each chunk, verify, refetch the bad ones
    directly; ``landed(jobs)`` once chunks are verified local copies (relays may serve them)."""
    held, src = active if active is not None else ({}, {})
    kept, copied, fetched = triage(jobs, want, here, held)
    if copied:  # chunks the active set holds (none without one)
        copy_local(copied, src, bufs)
    bad = bad_chunks(algo, kept + copied, bufs, want)
    bad_ids = {id(j) for j in bad}
    landed([j for j in kept + copied if id(j) not in bad_ids])
    fetch(fetched + [direct(j) for j in bad])
    # a direct TCP GET was checked by the wire against this very checksum; relays and shm copies were not
    unchecked = [j for j in fetched if len(j.sources) > 1 or j.sources[0].via is TransportKind.SHM]
    again = bad_chunks(algo, [direct(j) for j in bad] + unchecked, bufs, want)
    if again:
        fetch([direct(j) for j in again])
        still = bad_chunks(algo, again, bufs, want)
        if still:
            raise IntegrityError(
                "chunks differ from the trainer's checksum after a direct refetch",
                tensor=still[0].tensor,
                chunks=len(still),
            )
    moved = sum(j.nbytes for j in fetched + bad + again)
    return Landing(moved, sum(j.nbytes for j in copied), sum(j.nbytes for j in kept), len(bad) + len(again))
