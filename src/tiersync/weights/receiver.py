"""The sampler side: :class:`WeightReceiver` registers with every trainer shard, follows the
versions they announce, and switches its weights to each one atomically.

Per version: wait until every trainer shard announced it, plan with the shared planner
(identical on every party: same layouts, same options), take the standby buffer set (once
no reader holds it), run the jobs (:mod:`tiersync.weights.fetch`: shared-memory copies as
each tensor becomes ready, or TCP GETs, relays per the plan's stages), check that no segment
moved on to a later version meanwhile, commit (the switch), then answer every shard with an
ACK. A failure aborts the standby set (the active version stays), is answered as a failed
ACK and fails :meth:`receive`'s future for that version; the receiver keeps following later
versions. Every connection (control, GETs, relays) proves ``ReceiverConfig.token``, over TLS
when ``tls`` is set. Readers use :meth:`acquire` (a :class:`WeightsLease` on one complete version).
With ``ReceiverConfig.zero_copy`` the tensors :mod:`tiersync.weights.zerocopy` allows are not
copied: the commit installs read-only views of the segment, and a RELEASE tells the trainer
shards once this sampler no longer reads that version (until then they write elsewhere).
With ``ReceiverConfig.delta`` only changed chunks are fetched (:mod:`tiersync.weights.delta`).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from tiersync.errors import ClosedError, IntegrityError, RemoteError, TierSyncError, UsageError
from tiersync.net.errors import ProtocolError, ProtocolFault, log_level
from tiersync.net.server import TcpServer
from tiersync.net.socket_io import Deadline
from tiersync.net.tcp import TcpTransport
from tiersync.weights.buffers import VersionedBuffers, WeightsLease
from tiersync.weights.config import ReceiverConfig, ReceiveResult, TransportKind
from tiersync.weights.delta import DeltaState, Landing, land_delta
from tiersync.weights.fetch import Job, TcpPool, build_jobs, first_error, shm_copy
from tiersync.weights.links import ShardLink
from tiersync.weights.manifest import Manifest, destination_layout, host_id
from tiersync.weights.ops import WEIGHTS, Ack, Announce, Ready, Register, Release
from tiersync.weights.planner import plan_transfer
from tiersync.weights.segment import SegmentReader
from tiersync.weights.serving import SpanService
from tiersync.weights.sharding import Sharding, shard_boxes
from tiersync.weights.tensors import allocate
from tiersync.weights.zerocopy import zero_copy_views

__all__ = ["ReceiveResult", "WeightReceiver"]

log = logging.getLogger(__name__)
Progress = Callable[[int, int, int], None]


class WeightReceiver:
    """A sampler holding destination rank ``config.rank`` of ``destination``.

    ``destination``: a :class:`Sharding` for every tensor or a mapping name -> sharding (it must
    cover every tensor the trainer publishes). ``progress(version, done_bytes, total_bytes)`` is
    called after each chunk (from worker threads). ``allocator``: makes the weight arrays (e.g.
    in engine-provided or pinned memory); see :class:`VersionedBuffers`. Connects and registers on construction:
    UsageError when the trainer refuses the transport asked for, AuthError when a shard
    refused the token or TLS (or failed ours), RemoteError when a shard is unreachable.
    """

    def __init__(self, destination: Sharding | Mapping[str, Sharding], config: ReceiverConfig,
                 *, progress: Progress | None = None, allocator: Callable[[tuple, str], np.ndarray] | None = None) -> None:
        if not isinstance(config, ReceiverConfig):
            raise UsageError("expected a ReceiverConfig", argument="config")
        if not isinstance(destination, (Sharding, Mapping)):
            raise UsageError("expected a Sharding or a mapping name -> Sharding", argument="destination")
        self.config, self._destination, self._progress = config, destination, progress
        self._buffers = VersionedBuffers(config.buffers, allocator or allocate, on_release=self._released)
        self._cond = threading.Condition()
        self._shards = [ShardLink(r, a) for r, a in enumerate(config.publishers)]
        self._queue: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._queued: set[int] = set()
        self._waiters: dict[int, list[Future]] = {}
        self._failed: dict[int, BaseException] = {}
        self._last: ReceiveResult | None = None
        self._relay: tuple[int, dict[str, np.ndarray], set] | None = None  # version, buffers, done chunks
        self._closed = False
        self._stats = {"shm": 0, "tcp": 0, "relay": 0}
        tcp = config.tcp_config()
        self._transport = TcpTransport(tcp, WEIGHTS)
        self._pool = TcpPool(config.streams, tcp, config.io_timeout_s)
        self._delta = DeltaState(config.buffers, self._pool, config.max_meta_bytes)
        self._server = TcpServer(config.listen, SpanService(self._provide, config.io_timeout_s), tcp) \
            if config.relays else None
        try:
            for shard in self._shards:
                self._register(shard)
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
        return tuple(s.transport for s in self._shards)

    def stats(self) -> dict[str, int]:
        """Bytes landed so far by route: ``shm`` (segment copies), ``tcp`` (GETs from a trainer
        shard, relay fallbacks included) and ``relay`` (GETs from another sampler)."""
        with self._cond:
            return dict(self._stats)

    def receive(self, version: int) -> Future[ReceiveResult]:
        """A future resolved once version ``version`` or a later one is active (its result names
        which); failed with the sync's error when version ``version`` itself failed."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise UsageError("must be an int >= 0", argument="version", value=version)
        fut: Future = Future()
        with self._cond:
            if self._closed:
                raise ClosedError("receiver closed", argument="receiver")
            if self._last is not None and self._last.version >= version:
                fut.set_result(self._last)
            elif version in self._failed:
                fut.set_exception(self._failed[version])
            else:
                self._waiters.setdefault(version, []).append(fut)
        return fut

    def acquire(self, timeout: float | None = None) -> WeightsLease:
        """A lease on the active version (see :class:`VersionedBuffers.acquire`)."""
        return self._buffers.acquire(timeout)

    # -- control ---------------------------------------------------------------
    def _register(self, shard: ShardLink) -> None:
        cfg = self.config
        shard.register(self._transport, Register(0, cfg.label, cfg.rank, host_id(), cfg.transport,
                                                 self._server.address if self._server is not None else "",
                                                 cfg.zero_copy), cfg.io_timeout_s)
        threading.Thread(target=self._read_control, args=(shard,), daemon=True, name=f"ctl-{shard.rank}").start()

    def _read_control(self, shard: ShardLink) -> None:
        try:
            while True:
                event = shard.channel.receive()
                if isinstance(event, Announce):
                    self._announced(shard, event.manifest)
                elif isinstance(event, Ready):
                    with self._cond:
                        shard.ready[event.version] = event.count
                        self._cond.notify_all()
                else:
                    raise ProtocolError(f"unexpected {type(event).__name__}", fault=ProtocolFault.UNEXPECTED,
                                        peer=shard.address)
        except TierSyncError as exc:
            log.log(log_level(exc), "trainer shard %s control ended: %s", shard.rank, exc)
            shard.channel.close()
        with self._cond:
            shard.alive = False
            self._cond.notify_all()

    def _announced(self, shard: ShardLink, m: Manifest) -> None:
        if m.source_rank != shard.rank:
            raise ProtocolError("manifest of another source rank", fault=ProtocolFault.MALFORMED, peer=shard.address)
        with self._cond:
            shard.manifests[m.version] = m
            for old in [v for v in shard.manifests if v < m.version - 4]:
                shard.manifests.pop(old, None)
                shard.ready.pop(old, None)
            self._cond.notify_all()
            if m.version not in self._queued:
                self._queued.add(m.version)
                self._queue.put(m.version)

    # -- one version -----------------------------------------------------------
    def _sync_loop(self) -> None:
        while True:
            version = self._queue.get()
            if version is None or self._closed:
                return
            t0 = time.perf_counter()
            try:
                result = self._sync(version, t0)
            except BaseException as exc:  # noqa: BLE001 - reported to the trainer and the waiters
                log.info("sync of version %s failed: %s", version, exc)
                self._finish(version, None, exc, time.perf_counter() - t0)
            else:
                self._finish(version, result, None, result.seconds)

    def _sync(self, version: int, t0: float) -> ReceiveResult:
        deadline = Deadline(self.config.sync_timeout_s, "sync")
        manifests = self._manifests(version, deadline)
        m0 = manifests[0]
        specs = dict(zip(m0.names, m0.specs))
        plan = plan_transfer(dict(zip(m0.names, m0.source)), destination_layout(self._destination, m0), specs, m0.options)
        local = {n: shard_boxes(s.shape, plan.destination[n])[self.config.rank].shape for n, s in specs.items()}
        self._buffers.ensure({n: (local[n], specs[n].dtype) for n in m0.names})
        jobs = build_jobs(plan, self.config.rank, m0.index(), {s.rank: s.transport for s in self._shards},
                          {s.rank: s.address for s in self._shards}, {r: a for r, a in m0.peers.items()
                                                                     if r != self.config.rank})
        readers = {s.rank: s.readers[m.segment] for s, m in zip(self._shards, manifests)
                   if s.transport is TransportKind.SHM}
        views = zero_copy_views(jobs, manifests, readers, {n: (local[n], specs[n].dtype) for n in m0.names}) \
            if self.config.zero_copy else {}
        index, bufs = self._buffers.begin_write(self.config.lease_timeout_s)
        here = self._delta.begin(index)
        try:
            with self._cond:
                self._relay = (version, {**bufs, **views}, set())
            landing = self._land(version, [j for j in jobs if j.tensor not in views], manifests, bufs, here, deadline)
            self._await_views(version, [j for j in jobs if j.tensor in views], deadline)
            if any(not r.still_version(version) for r in readers.values()):
                raise IntegrityError("the trainer moved on while this sampler was reading", version=version)
            self._buffers.commit(index, version, views)
        except BaseException:
            with self._cond:
                self._relay = None
            self._buffers.abort(index)
            self._released(version)
            raise
        if not views:
            self._released(version)
        nbytes = sum(j.nbytes for j in jobs)
        return ReceiveResult(version, nbytes, time.perf_counter() - t0, self.transports(), landing.moved,
                             landing.copied)

    def _land(self, version: int, jobs: list[Job], manifests: list[Manifest], bufs: dict, here: tuple,
              deadline: Deadline) -> Landing:
        """Fetch ``jobs`` into ``bufs``: every one, or (delta) the changed ones, verified."""
        index = self._buffers.writing
        got = self._delta.sums(version, jobs, {s.rank: s.address for s in self._shards}) \
            if self.config.delta and jobs else None
        if got is None:
            self._run_jobs(version, jobs, manifests, bufs, deadline)
            return Landing(moved=sum(j.nbytes for j in jobs))
        algo, want = got
        other = self._buffers.active_set()
        held = self._delta.held(other[0]) if other is not None else (None, {})
        active = (held[1], other[1]) if other is not None and held[0] is algo else None
        landing = land_delta(algo, want, jobs, bufs, here[1] if here[0] is algo else {}, active,
                             lambda js: self._run_jobs(version, js, manifests, bufs, deadline), self._landed)
        self._delta.commit(index, algo, want)
        return landing

    def _landed(self, jobs: list[Job]) -> None:
        with self._cond:
            self._relay[2].update((j.tensor, j.key) for j in jobs)
            self._cond.notify_all()

    def _manifests(self, version: int, deadline: Deadline) -> list[Manifest]:
        with self._cond:
            while not all(version in s.manifests for s in self._shards):
                if any(not s.alive for s in self._shards if version not in s.manifests) or self._closed:
                    raise RemoteError("a trainer shard went away before announcing", version=version)
                self._cond.wait(deadline.remaining())
            manifests = [s.manifests[version] for s in self._shards]
        if any(not m.same_model(manifests[0]) or m.source_ranks != len(self._shards) for m in manifests):
            raise UsageError("trainer shards disagree on the model (or their number)", argument="publishers")
        for s, m in zip(self._shards, manifests):
            if s.transport is TransportKind.SHM and m.segment not in s.readers:
                s.readers[m.segment] = SegmentReader(m.segment, m.payload_bytes)
                for old in list(s.readers)[:-4]:  # a zero-copy lease keeps its mapping alive
                    s.readers.pop(old).close()
        return manifests

    def _await_views(self, version: int, jobs: list[Job], deadline: Deadline) -> None:
        """Zero-copy jobs: wait until their tensors are written, count them as landed."""
        for job in jobs:
            self._wait_ready(self._shards[job.sources[0].rank], version, job.index, deadline)
            with self._cond:
                self._relay[2].add((job.tensor, job.key))
                self._stats["shm"] += job.nbytes
                self._cond.notify_all()

    def _released(self, version: int) -> None:
        """Tell every trainer shard this sampler no longer reads ``version`` (zero-copy only)."""
        if not self.config.zero_copy:
            return
        for s in self._shards:
            if s.alive and s.transport is TransportKind.SHM:
                s.send(Release(version), self.config.io_timeout_s)

    def _run_jobs(self, version: int, jobs: list[Job], manifests: list[Manifest], bufs: dict, deadline: Deadline) -> None:
        total, done, errors = sum(j.nbytes for j in jobs), [0], []
        lock = threading.Lock()
        tcp = {s.address for j in jobs for s in j.sources if s.via is TransportKind.TCP}
        workers = min(32, max(1, self.config.copy_threads) + self.config.streams * len(tcp))

        def run(job: Job) -> None:
            if errors:
                return
            try:
                self._run_job(version, job, manifests, bufs[job.tensor], deadline)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
                return
            with self._cond:
                self._relay[2].add((job.tensor, job.key))
                self._cond.notify_all()
            with lock:
                done[0] += job.nbytes
                n = done[0]
            if self._progress is not None:
                self._progress(version, n, total)

        with ThreadPoolExecutor(workers, thread_name_prefix="fetch") as pool:
            list(pool.map(run, jobs))
        if errors:
            raise first_error(errors)

    def _run_job(self, version: int, job: Job, manifests: list[Manifest], dst: np.ndarray, deadline: Deadline) -> None:
        errors = []
        for n, src in enumerate(job.sources):
            try:
                if src.via is TransportKind.SHM:
                    m = manifests[src.rank]
                    self._wait_ready(self._shards[src.rank], version, job.index, deadline)
                    nbytes = int(np.prod(shard_boxes(m.specs[job.index].shape, m.source[job.index])[src.rank].shape))
                    shm_copy(self._shards[src.rank].readers[m.segment], m.offsets[job.index], nbytes * m.specs[job.index].itemsize,
                             src.span, dst, job.dst_span)
                else:
                    self._pool.get(src.address, version, job, src, dst)
                kind = "shm" if src.via is TransportKind.SHM else "relay" if n == 0 and len(job.sources) > 1 else "tcp"
                with self._cond:
                    self._stats[kind] += job.nbytes
                return
            except TierSyncError as exc:
                errors.append(exc)
        raise first_error(errors)

    def _wait_ready(self, shard: ShardLink, version: int, index: int, deadline: Deadline) -> None:
        with self._cond:
            while shard.ready.get(version, 0) <= index:
                if not shard.alive or self._closed:
                    raise RemoteError("trainer shard went away mid-version", peer=shard.address, version=version)
                self._cond.wait(deadline.remaining())

    def _provide(self, version: int, name: str, key: tuple, timeout: float):
        """Relay GETs: chunk ``key`` of ``name`` once it landed in this version's buffer."""
        end, chunk = time.monotonic() + timeout, (name, tuple(key))
        with self._cond:
            while self._relay is not None and self._relay[0] == version and chunk not in self._relay[2]:
                if not self._cond.wait(max(0.0, end - time.monotonic())):
                    break
            if self._relay is None or self._relay[0] != version or chunk not in self._relay[2]:
                raise RemoteError("this sampler does not hold that chunk of that version (yet)", version=version)
            arr = self._relay[1][name]
        return arr.reshape(-1).view(np.uint8), lambda: None  # a relay's bytes stay until the next version

    def _finish(self, version: int, result: ReceiveResult | None, error: BaseException | None, seconds: float) -> None:
        ack = Ack(version, error is None, max(0.0, seconds), "" if error is None else str(error)[:512],
                  0 if result is None else result.moved)
        for s in self._shards:
            if s.alive and version in s.manifests:
                s.send(ack, self.config.io_timeout_s)
        with self._cond:
            if result is not None:
                self._last = result
                ready = [v for v in self._waiters if v <= version]
                for v in ready:
                    for f in self._waiters.pop(v):
                        f.set_result(result)
            else:
                self._failed[version] = error
                for f in self._waiters.pop(version, []):
                    f.set_exception(error)

    def close(self) -> None:
        """Disconnect from the trainer, stop relaying; leases already taken stay readable."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._queue.put(None)
        if self._server is not None:
            self._server.close()
        self._pool.close()
        for s in self._shards:
            if s.channel is not None:
                s.channel.close()  # wakes the control reader blocked in receive
            for r in s.readers.values():
                r.close()
        self._buffers.close()
        with self._cond:
            for futs in self._waiters.values():
                for f in futs:
                    f.set_exception(ClosedError("receiver closed", argument="receiver"))
            self._waiters.clear()

    def __enter__(self) -> WeightReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
