"""Running a sampler's jobs of one version: each chunk from the first source that works.

:class:`JobRunner` lands jobs (:mod:`tiersync.weights.fetch`) into the sampler's buffers on a
thread pool: shared-memory copies once the trainer shard wrote the tensor, TCP GETs from a
trainer shard or a relaying sampler (falling back to the next source); chunks with one TCP
source go out pipelined, ``window`` GETs in flight on each of a sender's streams. Each landed chunk is
offered to relays (:class:`~tiersync.weights.relay_chunks.RelayChunks`) and reported to the
``progress`` hook; the bytes landed are counted per route (``shm``, ``tcp``, ``relay``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tiersync.errors import TierSyncError
from tiersync.net.socket_io import Deadline
from tiersync.weights.config import TransportKind
from tiersync.weights.fetch import Job, TcpPool, first_error, shm_copy
from tiersync.weights.links import TrainerLinks
from tiersync.weights.manifest import Manifest
from tiersync.weights.relay_chunks import RelayChunks
from tiersync.weights.sharding import shard_boxes

__all__ = ["JobRunner", "Progress"]

Progress = Callable[[int, int, int], None]


class JobRunner:
    """Lands jobs from ``links`` (shared memory) or ``pool`` (TCP) with up to ``copy_threads``
    copiers plus ``streams`` per TCP address (``window`` GETs in flight on each of a sender's
    streams); landed chunks go to ``relay`` and ``progress``."""

    def __init__(
        self,
        links: TrainerLinks,
        pool: TcpPool,
        relay: RelayChunks,
        progress: Progress | None,
        copy_threads: int,
        streams: int,
        window: int,
    ) -> None:
        self._links, self._pool, self._relay, self._progress = links, pool, relay, progress
        self._copy_threads, self._streams, self._window = copy_threads, streams, window
        self._lock = threading.Lock()
        self._stats = {"shm": 0, "tcp": 0, "relay": 0}

    def stats(self) -> dict[str, int]:
        """Bytes landed so far by route: ``shm``, ``tcp`` and ``relay``."""
        with self._lock:
            return dict(self._stats)

    def run(
        self,
        version: int,
        jobs: list[Job],
        manifests: list[Manifest],
        bufs: Mapping[str, np.ndarray],
        deadline: Deadline,
    ) -> None:
        """Land every one of ``jobs`` into ``bufs``; the first error once all stopped. Chunks
        with one TCP source go out pipelined on the sender's streams (:func:`_split`); relayed
        chunks are taken in order by up to ``streams`` workers per relay (:func:`_relay_feeds`)."""
        tally = _Tally(sum(j.nbytes for j in jobs))
        tcp = {s.address for j in jobs for s in j.sources if s.via is TransportKind.TCP}
        workers = min(32, max(1, self._copy_threads) + self._streams * len(tcp))
        feeds, rest = _split(jobs, self._streams)
        relayed, rest = _relay_feeds(rest, self._streams)
        with ThreadPoolExecutor(workers, thread_name_prefix="fetch") as pool:
            pending = [
                pool.submit(self._pipe, version, address, feed, bufs, deadline, tally) for address, feed in feeds
            ]
            pending += [
                pool.submit(self._in_order, version, feed, manifests, bufs, deadline, tally) for feed in relayed
            ]
            list(pool.map(lambda job: self._one(version, job, manifests, bufs, deadline, tally), rest))
            for f in pending:
                f.result()
        if tally.errors:
            raise first_error(tally.errors)

    def _one(
        self,
        version: int,
        job: Job,
        manifests: list[Manifest],
        bufs: Mapping[str, np.ndarray],
        deadline: Deadline,
        tally: _Tally,
    ) -> None:
        if tally.errors:
            return
        try:
            self._run_job(version, job, manifests, bufs[job.tensor], deadline, tally.dead)
            self._finished(version, job, tally)
        except BaseException as exc:  # noqa: BLE001 - a failed job, or the progress hook raised
            tally.failed(exc)

    def _in_order(
        self,
        version: int,
        feed: _Feed,
        manifests: list[Manifest],
        bufs: Mapping[str, np.ndarray],
        deadline: Deadline,
        tally: _Tally,
    ) -> None:
        """The jobs this worker takes from ``feed``, one after the other."""
        for job in feed:
            self._one(version, job, manifests, bufs, deadline, tally)

    def _pipe(
        self, version: int, address: str, feed: _Feed, bufs: Mapping[str, np.ndarray], deadline: Deadline, tally: _Tally
    ) -> None:
        """GETs of the jobs this stream takes from ``feed`` (one sender, one source each) on one
        channel, ``window`` in flight, within the sync's deadline (each step within
        ``io_timeout_s``). Stops once another job of the version failed."""

        def landed(job: Job) -> None:
            with self._lock:
                self._stats["tcp"] += job.nbytes
            self._finished(version, job, tally)
            if tally.errors:
                raise _Abandoned

        if tally.errors:
            return
        try:
            self._pool.get_many(address, version, feed, bufs, self._window, landed, deadline.remaining())
        except _Abandoned:
            pass
        except BaseException as exc:  # noqa: BLE001
            tally.failed(exc)

    def _finished(self, version: int, job: Job, tally: _Tally) -> None:
        self._relay.landed([job])
        n = tally.landed(job.nbytes)
        if self._progress is not None:
            self._progress(version, n, tally.total)

    def _run_job(
        self, version: int, job: Job, manifests: list[Manifest], dst: np.ndarray, deadline: Deadline, dead: set[str]
    ) -> None:
        """Land ``job`` from its first source that serves it. A relay that failed once this run
        (``dead``) is skipped: its other chunks go to the next source at once, not after a
        timeout each; a relay GET also ends with the sync's deadline."""
        errors: list[TierSyncError] = []
        for n, src in enumerate(job.sources):
            relay = n < len(job.sources) - 1 and src.via is TransportKind.TCP
            if relay and src.address in dead:
                continue
            try:
                if src.via is TransportKind.SHM:
                    m = manifests[src.rank]
                    assert m.segment is not None  # TrainerLinks.manifests refused an SHM shard without one
                    self._links.wait_ready(src.rank, src.incarnation, version, job.index, deadline)
                    nbytes = int(np.prod(shard_boxes(m.specs[job.index].shape, m.source[job.index])[src.rank].shape))
                    shm_copy(
                        self._links.reader(src.rank, m.segment),
                        m.offsets[job.index],
                        nbytes * m.specs[job.index].itemsize,
                        src.span,
                        dst,
                        job.dst_span,
                    )
                else:
                    self._pool.get(src.address, version, job, src, dst, deadline.remaining())
                kind = "shm" if src.via is TransportKind.SHM else "relay" if n == 0 and len(job.sources) > 1 else "tcp"
                with self._lock:
                    self._stats[kind] += job.nbytes
                return
            except TierSyncError as exc:
                errors.append(exc)
                if relay:
                    dead.add(src.address)
        raise first_error(errors)

    def await_views(self, version: int, jobs: list[Job], deadline: Deadline) -> None:
        """Zero-copy jobs: wait until their tensors are written, count them as landed."""
        for job in jobs:
            src = job.sources[0]
            self._links.wait_ready(src.rank, src.incarnation, version, job.index, deadline)
            self._relay.landed([job])
            with self._lock:
                self._stats["shm"] += job.nbytes


class _Tally:
    """One run's bytes landed (of ``total``) and the errors its jobs raised."""

    def __init__(self, total: int) -> None:
        self.total, self._done = total, 0
        self.errors: list[BaseException] = []
        self.dead: set[str] = set()  # relays that failed a GET this run
        self._lock = threading.Lock()

    def landed(self, nbytes: int) -> int:
        """Count ``nbytes`` more landed; the bytes landed so far."""
        with self._lock:
            self._done += nbytes
            return self._done

    def failed(self, exc: BaseException) -> None:
        with self._lock:
            self.errors.append(exc)


class _Abandoned(Exception):
    """A pipelined batch stopped because another job of the version failed."""


class _Feed:
    """One sender's jobs, in order, each to whichever of its streams asks next (a stream
    finishing its chunks early takes more); thread-safe."""

    def __init__(self, jobs: list[Job]) -> None:
        self._jobs, self._lock = iter(jobs), threading.Lock()

    def __iter__(self) -> _Feed:
        return self

    def __next__(self) -> Job:
        with self._lock:
            return next(self._jobs)


def _split(jobs: list[Job], streams: int) -> tuple[list[tuple[str, _Feed]], list[Job]]:
    """(address, feed) per stream to pipeline on, from the jobs whose one source is a TCP
    sender, and the other jobs in order (shared memory, relays). A sender that relayed jobs may
    fall back to keeps one of its ``streams`` channels free for them (with one stream, its jobs
    are not pipelined)."""
    fallback = {s.address for j in jobs for s in j.sources[1:] if s.via is TransportKind.TCP}
    by_sender: dict[str, list[Job]] = {}
    rest = []
    for job in jobs:
        one = job.sources[0] if len(job.sources) == 1 else None
        if one is not None and one.via is TransportKind.TCP and streams - (one.address in fallback) > 0:
            by_sender.setdefault(one.address, []).append(job)
        else:
            rest.append(job)
    feeds = {address: _Feed(group) for address, group in by_sender.items()}
    ways = {address: min(len(group), streams - (address in fallback)) for address, group in by_sender.items()}
    return [(address, feeds[address]) for address in feeds for _ in range(ways[address])], rest


def _relay_feeds(jobs: list[Job], streams: int) -> tuple[list[_Feed], list[Job]]:
    """A feed per worker for the jobs relayed by another sampler (up to ``streams`` workers per
    relay, each taking the relay's next job in order), and the other jobs. A worker takes a
    later chunk only once it is done with an earlier one, so a relay's channels (``streams``
    of them) are never all held by chunks the relay lands late while an earlier chunk, which
    the relay itself may need from this sampler first, waits for a channel."""
    by_relay: dict[str, list[Job]] = {}
    rest = []
    for job in jobs:
        first = job.sources[0]
        if len(job.sources) > 1 and first.via is TransportKind.TCP:
            by_relay.setdefault(first.address, []).append(job)
        else:
            rest.append(job)
    feeds = [(_Feed(group), min(len(group), streams)) for group in by_relay.values()]
    return [feed for feed, ways in feeds for _ in range(ways)], rest
