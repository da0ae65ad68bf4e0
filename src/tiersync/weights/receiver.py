"""The sampler side: :class:`WeightReceiver` registers with every trainer shard, follows the
versions they announce, and switches its weights to each one atomically.

Per version: wait until every trainer shard announced it (:mod:`~tiersync.weights.links`),
plan with the shared planner (identical on every party: same layouts, same options), take the
standby buffer set (once no reader holds it), run the jobs (:mod:`~tiersync.weights.job_runner`
over :mod:`tiersync.weights.fetch`: shared-memory copies as each tensor becomes ready, or TCP
GETs, relays per the plan's stages), check that no segment moved on to a later version
meanwhile, commit (the switch), then answer every shard with an ACK. A failure aborts the
standby set (the active version stays), is answered as a failed ACK and fails
:meth:`receive`'s future for that version (:mod:`~tiersync.weights.version_queue`); the
receiver keeps following later versions. Every connection (control, GETs, relays) proves
``ReceiverConfig.token``, over TLS when ``tls`` is set. Readers use :meth:`acquire` (a
:class:`WeightsLease` on one complete version).
With ``ReceiverConfig.zero_copy`` the tensors :mod:`tiersync.weights.zerocopy` allows are not
copied: the commit installs read-only views of the segment, and a RELEASE tells the trainer
shards once this sampler no longer reads that version (until then they write elsewhere).
With ``ReceiverConfig.delta`` only changed chunks are fetched (:mod:`tiersync.weights.delta`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future

import numpy as np

from tiersync.errors import IntegrityError, UsageError
from tiersync.net.frames import PayloadChecksum
from tiersync.net.server import TcpServer
from tiersync.net.socket_io import Deadline
from tiersync.net.tcp import TcpTransport
from tiersync.weights.buffers import VersionedBuffers, WeightsLease
from tiersync.weights.config import ReceiverConfig, ReceiveResult, TransportKind, process_label
from tiersync.weights.delta import ChunkKey, DeltaState, Landing, bad_chunks, direct, land_delta
from tiersync.weights.fetch import Job, TcpPool, build_jobs
from tiersync.weights.job_runner import JobRunner, Progress
from tiersync.weights.links import TrainerLinks
from tiersync.weights.manifest import Manifest, destination_layout, host_id
from tiersync.weights.ops import WEIGHTS, Ack, Register
from tiersync.weights.planner import plan_transfer
from tiersync.weights.relay_chunks import RelayChunks
from tiersync.weights.serving import SpanService
from tiersync.weights.sharding import Sharding, shard_boxes
from tiersync.weights.tensors import allocate
from tiersync.weights.version_queue import Announced, VersionQueue
from tiersync.weights.zerocopy import zero_copy_views

__all__ = ["ReceiveResult", "WeightReceiver"]

log = logging.getLogger(__name__)


class WeightReceiver:
    """A sampler holding destination rank ``config.rank`` of ``destination``.

    ``destination``: a :class:`Sharding` for every tensor or a mapping name -> sharding (it must
    cover every tensor the trainer publishes). ``progress(version, done_bytes, total_bytes)`` is
    called after each chunk (from worker threads; keep it short: a stream's next answers wait
    behind it, and an exception fails the sync). ``allocator``: makes the weight arrays (e.g.
    in engine-provided or pinned memory); see :class:`VersionedBuffers`. Connects and registers on construction:
    UsageError when the trainer refuses the transport asked for, AuthError when a shard
    refused the token or TLS (or failed ours), RemoteError when a shard is unreachable.
    """

    def __init__(
        self,
        destination: Sharding | Mapping[str, Sharding],
        config: ReceiverConfig,
        *,
        progress: Progress | None = None,
        allocator: Callable[[tuple[int, ...], str], np.ndarray] | None = None,
    ) -> None:
        if not isinstance(config, ReceiverConfig):
            raise UsageError("expected a ReceiverConfig", argument="config")
        if not isinstance(destination, (Sharding, Mapping)):
            raise UsageError("expected a Sharding or a mapping name -> Sharding", argument="destination")
        self.config, self._destination = config, destination
        self._buffers = VersionedBuffers(config.buffers, allocator or allocate, on_release=self._released)
        self._versions = VersionQueue()
        self._synced: tuple[tuple[int, tuple[int, ...]], ReceiveResult] | None = None  # (version, incarnations)
        self._used: tuple[int, ...] = ()  # the incarnations the version being synced is of
        self._links = TrainerLinks(list(config.publishers), config.io_timeout_s, self._versions.announced)
        self._relay = RelayChunks()
        tcp = config.tcp_config()
        self._transport = TcpTransport(tcp, WEIGHTS)
        self._pool = TcpPool(config.streams, tcp, config.io_timeout_s)
        self._runner = JobRunner(
            self._links, self._pool, self._relay, progress, config.copy_threads, config.streams, config.window
        )
        self._delta = DeltaState(config.buffers, self._pool, config.max_meta_bytes)
        self._server = (
            TcpServer(config.listen, SpanService(self._relay.provide, config.io_timeout_s), tcp)
            if config.relays
            else None
        )
        relay = self._server.address if self._server is not None else ""
        self.label = config.sampler_id or process_label("sampler", config.rank)
        """The label this sampler registered under (``config.sampler_id``, else one of its own)."""
        hello = Register(0, self.label, config.rank, host_id(), config.transport, relay, config.zero_copy)
        try:
            self._links.connect(self._transport, hello)
        except BaseException:
            self.close()
            raise
        self._worker = threading.Thread(target=self._sync_loop, name=f"sync-{config.rank}", daemon=True)
        self._worker.start()

    # -- public API ------------------------------------------------------------
    @property
    def version(self) -> int | None:
        """The active version (None before the first one)."""
        return self._buffers.version

    def transports(self) -> tuple[TransportKind, ...]:
        """Per trainer shard, the transport it granted (SHM or TCP)."""
        return self._links.transports()

    def stats(self) -> dict[str, int]:
        """Bytes landed so far by route: ``shm`` (segment copies), ``tcp`` (GETs from a trainer
        shard, relay fallbacks included) and ``relay`` (GETs from another sampler)."""
        return self._runner.stats()

    def receive(self, version: int) -> Future[ReceiveResult]:
        """A future resolved once version ``version`` or a later one is active (its result names
        which); failed with the sync's error when version ``version`` itself failed."""
        return self._versions.receive(version)

    def acquire(self, timeout: float | None = None) -> WeightsLease:
        """A lease on the active version (see :class:`VersionedBuffers.acquire`)."""
        return self._buffers.acquire(timeout)

    # -- one version -----------------------------------------------------------
    def _sync_loop(self) -> None:
        while True:
            got = self._versions.next()
            if got is None:
                return
            t0 = time.perf_counter()
            self._used = got.incarnations()  # whom the answer is for: the manifests' incarnations once read
            try:
                result = self._sync(got, t0)
            except BaseException as exc:  # noqa: BLE001 - reported to the trainer and the waiters
                log.info("sync of version %s failed: %s", got.version, exc)
                self._relay.give_up(got.version)  # readers' GETs waiting for it to begin are refused now
                self._finish(got, None, exc, time.perf_counter() - t0)
            else:
                self._finish(got, result, None, result.seconds)

    def _sync(self, got: Announced, t0: float) -> ReceiveResult:
        deadline, version = Deadline(self.config.sync_timeout_s, "sync"), got.version
        manifests = self._links.manifests(got, deadline)
        used = self._used = tuple(m.incarnation for m in manifests)
        key = (version, used)
        if self._synced is not None and self._synced[0] == key and self._buffers.version == version:
            return self._synced[1]  # announced again by a shard that came back before it was synced
        try:  # the trainer counts this sampler a holder of the version until told otherwise
            jobs, local = self._jobs(manifests)
            readers = self._links.readers(manifests)
            views = zero_copy_views(jobs, manifests, readers, local) if self.config.zero_copy else {}
            index, bufs = self._buffers.begin_write(self.config.lease_timeout_s)
        except BaseException:
            self._released(used, version)
            raise
        here = self._delta.begin(index)
        try:
            self._relay.begin(version, {**bufs, **views})
            landing = self._land(version, [j for j in jobs if j.tensor not in views], manifests, bufs, here, deadline)
            self._runner.await_views(version, [j for j in jobs if j.tensor in views], deadline)
            if any(not r.still_version(version) for r in readers.values()):
                raise IntegrityError("the trainer moved on while this sampler was reading", version=version)
            self._buffers.commit(index, version, views, used)
        except BaseException:
            self._relay.drop()
            self._buffers.abort(index)
            self._released(used, version)
            raise
        if not views:
            self._released(used, version)
        nbytes = sum(j.nbytes for j in jobs)
        result = ReceiveResult(
            version, nbytes, time.perf_counter() - t0, self.transports(), landing.moved, landing.copied
        )
        self._synced = (key, result)
        return result

    def _jobs(self, manifests: list[Manifest]) -> tuple[list[Job], dict[str, tuple[tuple[int, ...], str]]]:
        """This rank's jobs of the version of ``manifests`` and its local (shape, dtype) per
        tensor; the buffer sets made to fit."""
        m0 = manifests[0]
        specs = dict(zip(m0.names, m0.specs))
        plan = plan_transfer(
            dict(zip(m0.names, m0.source)), destination_layout(self._destination, m0), specs, m0.options
        )
        local = {n: shard_boxes(s.shape, plan.destination[n])[self.config.rank].shape for n, s in specs.items()}
        self._buffers.ensure({n: (local[n], specs[n].dtype) for n in m0.names})
        peers = {r: a for r, a in m0.peers.items() if r != self.config.rank}
        incarnations = {m.source_rank: m.incarnation for m in manifests}
        jobs = build_jobs(
            plan,
            self.config.rank,
            m0.index(),
            self._links.transport_map(),
            self._links.addresses(),
            peers,
            incarnations,
        )
        return jobs, {n: (local[n], specs[n].dtype) for n in m0.names}

    def _land(
        self,
        version: int,
        jobs: list[Job],
        manifests: list[Manifest],
        bufs: dict[str, np.ndarray],
        here: tuple[PayloadChecksum | None, dict[ChunkKey, int]],
        deadline: Deadline,
    ) -> Landing:
        """Fetch ``jobs`` into ``bufs``: every one, or (delta) the changed ones, verified."""
        index = self._buffers.writing
        got = self._delta.sums(version, jobs, self._links.addresses()) if self.config.delta and jobs else None
        if got is None:
            self._runner.run(version, jobs, manifests, bufs, deadline)
            refetched = self._verify_relayed(
                version, [j for j in jobs if len(j.sources) > 1], manifests, bufs, deadline
            )
            return Landing(moved=sum(j.nbytes for j in jobs + refetched), refetched=len(refetched))
        algo, want = got
        other = self._buffers.active_set()
        held = self._delta.held(other[0]) if other is not None else (None, {})
        active = (held[1], other[1]) if other is not None and held[0] is algo else None
        landing = land_delta(
            algo,
            want,
            jobs,
            bufs,
            here[1] if here[0] is algo else {},
            active,
            lambda js: self._runner.run(version, js, manifests, bufs, deadline),
            self._relay.landed,
        )
        assert index is not None  # _sync holds the set begin_write gave it until commit or abort
        self._delta.commit(index, algo, want)
        return landing

    def _verify_relayed(
        self,
        version: int,
        relayed: list[Job],
        manifests: list[Manifest],
        bufs: dict[str, np.ndarray],
        deadline: Deadline,
    ) -> list[Job]:
        """Chunks a relay served were checked against that relay's checksum only: check them
        against the trainer's (W_SUMS) and refetch from it directly those that differ (every one
        when its checksums are of an algorithm this build cannot compute); those refetched."""
        if not relayed:
            return []
        got = self._delta.sums(version, relayed, self._links.addresses())
        bad = relayed if got is None else bad_chunks(got[0], relayed, bufs, got[1])
        if bad:  # a direct GET is checked by the wire against the trainer's own checksum
            log.warning("%d relayed chunks of version %d differ from the trainer's: refetched", len(bad), version)
            self._runner.run(version, [direct(j) for j in bad], manifests, bufs, deadline)
        return bad

    def _released(self, incarnations: tuple[int, ...], version: int) -> None:
        """Tell the trainer shards (still of ``incarnations``) this sampler no longer reads
        ``version`` (zero-copy only)."""
        if self.config.zero_copy:
            self._links.release(incarnations, version)

    def _finish(
        self, got: Announced, result: ReceiveResult | None, error: BaseException | None, seconds: float
    ) -> None:
        ack = Ack(
            got.version,
            error is None,
            max(0.0, seconds),
            "" if error is None else str(error)[:512],
            0 if result is None else result.moved,
        )
        self._links.answer(self._used, ack)
        self._versions.settle(got.version, result, error, got.epoch)

    def close(self) -> None:
        """Disconnect from the trainer, stop relaying; leases already taken stay readable."""
        if not self._versions.stop():
            return
        try:
            self._links.stop()
            if self._server is not None:
                self._server.close()
            self._pool.close()
            self._links.close()
        finally:  # whatever failed above, no waiter is left waiting
            try:
                self._buffers.close()
            finally:
                self._versions.close()

    def __enter__(self) -> WeightReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
