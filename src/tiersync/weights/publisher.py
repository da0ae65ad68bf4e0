"""The trainer side: one :class:`WeightPublisher` per trainer shard (source rank).

It owns the shard's named tensors (numpy, torch or JAX; any device) and one version buffer:
a ``/dev/shm`` segment when :attr:`PublisherConfig.shm` (same-host samplers read it in place:
one write, many readers) or anonymous memory. :meth:`WeightPublisher.publish` runs, in order
on one worker thread: announce version v to every registered sampler, copy each tensor D2H
into the buffer and tell the samplers it is ready (so they copy tensor i while i+1 is being
written), then wait for every sampler's answer. The returned future's
:class:`PublishResult` has one :class:`SamplerOutcome` per sampler; a sampler that dies or
times out fails only its own outcome. A sampler that registers again (same rank) replaces
its old registration and takes part from the next publish on.
"""
from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tiersync.errors import ClosedError, TierSyncError, UsageError
from tiersync.net import events as ev
from tiersync.net.errors import NetTimeoutError, RemoteError
from tiersync.net.server import TcpServer
from tiersync.net.service import Session
from tiersync.weights.config import PublisherConfig, SyncStatus, TransportKind
from tiersync.weights.manifest import Manifest, host_id
from tiersync.weights.ops import Ack, Announce, Ready, Register, Release, Welcome
from tiersync.weights.segment import SEGMENT_PREFIX, SegmentPool, tensor_offsets
from tiersync.weights.serving import SpanService
from tiersync.weights.sharding import Sharding, local_shape
from tiersync.weights.tensors import host_bytes, tensor_spec
from tiersync.weights.transfer_plan import PlanOptions
from tiersync.weights.validate import validate_source

__all__ = ["PublishResult", "SamplerOutcome", "WeightPublisher"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SamplerOutcome:
    """One sampler's answer for one version. ``error`` is None when ``status`` is OK.
    ``moved``: bytes that sampler fetched for the version (from every trainer shard and its
    relays; a delta sync fetches only changed chunks), as it reported them."""

    sampler: str
    rank: int
    status: SyncStatus
    transport: TransportKind
    error: str | None = None
    seconds: float | None = None
    moved: int = 0


@dataclass(frozen=True, slots=True)
class PublishResult:
    """The outcome of :meth:`WeightPublisher.publish`: per sampler, and the wall time.
    ``nbytes``: this trainer shard's bytes of the version; :attr:`moved`: bytes the samplers fetched."""

    version: int
    outcomes: tuple[SamplerOutcome, ...]
    seconds: float
    nbytes: int

    @property
    def ok(self) -> bool:
        """True when every sampler that was registered at announce time switched to the version."""
        return all(o.status is SyncStatus.OK for o in self.outcomes)

    @property
    def failed(self) -> tuple[SamplerOutcome, ...]:
        return tuple(o for o in self.outcomes if o.status is not SyncStatus.OK)

    @property
    def moved(self) -> int:
        """Bytes every sampler together fetched for this version (their reports; every trainer
        shard's result carries the same total)."""
        return sum(o.moved for o in self.outcomes)


@dataclass(eq=False)
class _Sampler:
    label: str
    rank: int
    session: Session  # its control connection
    transport: TransportKind
    relay: str
    zc: bool = False  # serves from the segment (zero-copy): holds each version until RELEASE
    alive: bool = True
    acks: dict[int, Ack] = field(default_factory=dict)


class WeightPublisher:
    """Publishes ``tensors`` (this shard's local tensors, in write order) as source rank ``rank``.

    ``layout``: a :class:`Sharding` for every tensor or a mapping name -> sharding; every mesh
    must number its ranks ``0..n-1`` (samplers index publishers by source rank).
    ``global_shapes``: name -> global shape; by default the local shape times the shard count
    per dimension (refused when that does not reproduce the local shape). Raises
    :class:`UsageError` naming the argument; nothing is started then.
    """

    def __init__(self, tensors: Mapping[str, Any], layout: Sharding | Mapping[str, Sharding], *, rank: int = 0,
                 config: PublisherConfig | None = None, global_shapes: Mapping[str, tuple[int, ...]] | None = None):
        self.config = config or PublisherConfig()
        if not isinstance(self.config, PublisherConfig):
            raise UsageError("expected a PublisherConfig", argument="config")
        self.rank = rank
        self._names, self._specs, self._source = validate_source(tensors, layout, rank, global_shapes)
        self._index = {n: i for i, n in enumerate(self._names)}
        self._tensors = dict(tensors)
        self._local = [int(np.prod(local_shape(s.shape, sh, rank))) * s.itemsize
                       for s, sh in zip(self._specs, self._source)]
        self._offsets, payload = tensor_offsets(self._local)
        self.nbytes = sum(self._local)
        self._host = host_id()
        self._payload = payload
        self._pool: SegmentPool | None = None
        if self.config.shm:
            path = os.path.join(self.config.shm_dir, f"{SEGMENT_PREFIX}{os.getpid()}-{rank}-{secrets.token_hex(4)}")
            self._pool = SegmentPool(path, payload)
            self._store = self._segment_store(-1, set())
        else:
            self._store = np.zeros(payload, np.uint8)
        self._cond = threading.Condition()
        self._samplers: dict[int, _Sampler] = {}
        self._by_session: dict[int, _Sampler] = {}
        self._current: int | None = None  # version GETs may read
        self._ready = 0
        self._inflight = 0
        self._last_version: int | None = None
        self._closed = False
        self._worker = ThreadPoolExecutor(1, thread_name_prefix=f"publish-{rank}")
        service = SpanService(self._provide, self.config.io_timeout_s, control=self._control, ended=self._ended)
        self._server = TcpServer(self.config.listen, service, self.config.tcp_config(f"weights-publisher-{rank}"))

    @property
    def address(self) -> str:
        """The "host:port" samplers connect to (give it to ``ReceiverConfig.publishers``)."""
        return self._server.address

    @property
    def segment_path(self) -> str | None:
        return None if self._pool is None else self._pool.current.path

    def _segment_store(self, version: int, holders: set) -> np.ndarray:
        """Switch to the pool's segment for ``version`` (held by ``holders``): its payload view."""
        self._store = np.zeros(0, np.uint8)  # drop the old view before the pool may unmap it
        seg = self._pool.take(version, holders)
        return seg.region(self._offsets[0], self._payload) if self._payload else np.zeros(0, np.uint8)

    def samplers(self) -> dict[int, str]:
        """Registered, connected samplers: rank -> label."""
        with self._cond:
            return {r: s.label for r, s in self._samplers.items() if s.alive}

    def wait_for_samplers(self, count: int, timeout: float) -> None:
        """Block until ``count`` samplers are registered; NetTimeoutError after ``timeout`` seconds."""
        end = time.monotonic() + timeout
        with self._cond:
            while sum(s.alive for s in self._samplers.values()) < count:
                left = end - time.monotonic()
                if left <= 0 or self._closed:
                    raise NetTimeoutError(f"{len(self._samplers)} of {count} samplers registered", peer=self.address)
                self._cond.wait(left)

    # -- publishing ------------------------------------------------------------
    def publish(self, version: int, tensors: Mapping[str, Any] | None = None) -> Future[PublishResult]:
        """Send version ``version`` (an int above every earlier one) to every registered sampler.

        ``tensors``: replacement objects (same names, shapes, dtypes) to read from now on, e.g.
        new JAX arrays; None re-reads the registered ones (updated in place by training).
        Publishes run one at a time in call order. The future fails only for a local error
        (the trainer's tensors could not be read); sampler failures are in the result.
        """
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise UsageError("must be an int >= 0", argument="version", value=version)
        replace = self._check_replacement(tensors)
        with self._cond:
            if self._closed:
                raise ClosedError("publisher closed", argument="publisher")
            if self._last_version is not None and version <= self._last_version:
                raise UsageError("must exceed the last published version", argument="version",
                                 value=version, last=self._last_version)
            self._last_version = version
            if replace:
                self._tensors.update(replace)
        return self._worker.submit(self._run, version)

    def _check_replacement(self, tensors: Mapping[str, Any] | None) -> dict[str, Any]:
        if tensors is None:
            return {}
        if not isinstance(tensors, Mapping):
            raise UsageError("expected a mapping name -> tensor", argument="tensors")
        for name, t in tensors.items():
            if name not in self._names:
                raise UsageError(f"unknown tensor {name!r}", argument="tensors")
            i = self._names.index(name)
            if tensor_spec(t, "tensors") != (local_shape(self._specs[i].shape, self._source[i], self.rank),
                                             self._specs[i].dtype):
                raise UsageError(f"tensor {name!r} changed shape or dtype", argument="tensors")
        return dict(tensors)

    def _run(self, version: int) -> PublishResult:
        t0 = time.perf_counter()
        with self._cond:
            targets = [s for s in self._samplers.values() if s.alive]
        self._begin(version, targets)
        announce = Announce(self._manifest(version, targets))
        for s in targets:
            self._send(s, announce)
        for i, name in enumerate(self._names):
            src = host_bytes(self._tensors[name], name)
            np.copyto(self._store[self._offsets[i] - self._offsets[0]:][: self._local[i]], src)
            with self._cond:
                self._ready = i + 1
                self._cond.notify_all()
            for s in targets:
                if s.alive:
                    self._send(s, Ready(version, i + 1))
        if self._pool is not None:
            self._pool.current.complete(version)
        outcomes = self._collect(version, targets)
        return PublishResult(version, outcomes, time.perf_counter() - t0, self.nbytes)

    def _begin(self, version: int, targets: list[_Sampler]) -> None:
        """Refuse GETs of the old version, let the running ones finish, mark the new one (in a
        segment no zero-copy sampler still reads; those among ``targets`` hold it from now)."""
        end = time.monotonic() + self.config.io_timeout_s
        with self._cond:
            self._current, self._ready = None, 0
            self._cond.notify_all()  # GETs waiting for the old version give up now
            while self._inflight and time.monotonic() < end:
                self._cond.wait(end - time.monotonic())
            if self._pool is not None:
                self._store = self._segment_store(version, {s for s in targets if s.zc})
                self._pool.current.begin(version)
            self._current = version

    def _manifest(self, version: int, targets: list[_Sampler]) -> Manifest:
        opts = PlanOptions(self.config.fanout, self.config.segment_bytes)
        return Manifest(version, self.rank, self._source[0].mesh.size, tuple(self._names), tuple(self._specs),
                        tuple(self._source), tuple(self._offsets), self._payload,
                        None if self._pool is None else self._pool.current.path, self._host, opts,
                        {s.rank: s.relay for s in targets if s.relay})

    def _collect(self, version: int, targets: list[_Sampler]) -> tuple[SamplerOutcome, ...]:
        end = time.monotonic() + self.config.publish_timeout_s
        with self._cond:
            while any(s.alive and version not in s.acks for s in targets):
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return tuple(_outcome(s, version) for s in sorted(targets, key=lambda s: s.rank))

    def _send(self, s: _Sampler, event: object) -> None:
        try:
            s.session.send(event, timeout=self.config.io_timeout_s)
        except (TierSyncError, OSError) as exc:
            log.info("sampler %s dropped: %s", s.label, exc)
            self._drop(s)

    # -- serving (one TcpServer: control sessions and GETs, on its worker pool) ---------------
    def _provide(self, version: int, name: str, key: tuple, timeout: float):
        i = self._index.get(name)
        if i is None:
            raise UsageError(f"unknown tensor {name!r}", argument="tensor")
        end = time.monotonic() + timeout
        with self._cond:
            while self._current == version and self._ready <= i and time.monotonic() < end:
                self._cond.wait(end - time.monotonic())
            if self._current != version or self._ready <= i:
                raise RemoteError("version not being served (or not written in time)", version=version,
                                  current=self._current)
            self._inflight += 1
        lo = self._offsets[i] - self._offsets[0]
        return self._store[lo: lo + self._local[i]], self._release

    def _release(self) -> None:
        with self._cond:
            self._inflight -= 1
            self._cond.notify_all()

    def _control(self, session: Session, event: object) -> Iterable[object]:
        """W_REGISTER -> W_WELCOME; then the sampler's one-way W_ACK and W_RELEASE."""
        if isinstance(event, Register):
            return self._register(session, event)
        with self._cond:
            s = self._by_session.get(session.session_id)
            known = s is not None and isinstance(event, (Ack, Release))
            if known and isinstance(event, Ack):
                s.acks[event.version] = event
            elif known and self._pool is not None:
                self._pool.release(s, event.version)
            self._cond.notify_all()
        if not known:
            log.info("closing %s: %s out of place", session.peer, type(event).__name__)
            session.close()
        return ()

    def _register(self, session: Session, hello: Register):
        """A generator: W_WELCOME is written before the sampler takes part (so no ANNOUNCE
        overtakes it); a registration that replaces one of the same rank drops the old one."""
        shm_ok = self._pool is not None and hello.host == self._host
        if hello.transport is TransportKind.SHM and not shm_ok:
            yield ev.Error(hello.request_id, ev.ErrorCode.UNSUPPORTED,
                           "shared memory is not available to this sampler (other host or no segment)")
            return
        got = TransportKind.SHM if shm_ok and hello.transport is not TransportKind.TCP else TransportKind.TCP
        yield Welcome(hello.request_id, got, self.rank)
        zc = got is TransportKind.SHM and hello.zero_copy
        s = _Sampler(hello.label, hello.rank, session, got, hello.relay, zc=zc)
        with self._cond:
            old = self._samplers.get(s.rank)
            self._samplers[s.rank] = s
            self._by_session[session.session_id] = s
            self._cond.notify_all()
        if old is not None:
            self._drop(old)
        if session.closed or self._closed:  # ended while it was being welcomed
            self._drop(s)

    def _ended(self, session: Session) -> None:
        with self._cond:
            s = self._by_session.get(session.session_id)
        if s is not None:
            log.info("sampler %s disconnected", s.label)
            self._drop(s)

    def _drop(self, s: _Sampler) -> None:
        """Once per sampler: forget it, retire the segments it held, end its session."""
        with self._cond:
            if not s.alive:
                return
            s.alive = False
            if self._samplers.get(s.rank) is s:
                del self._samplers[s.rank]
            self._by_session.pop(s.session.session_id, None)
            if self._pool is not None and s.zc:
                self._pool.orphan(s)  # it may still serve from them: never rewrite those
            self._cond.notify_all()
        s.session.close()

    def close(self) -> None:
        """Stop serving, drop the samplers, unlink the segment; idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            samplers = list(self._samplers.values())
            self._cond.notify_all()
        self._worker.shutdown(wait=True)
        self._server.close()
        for s in samplers:
            self._drop(s)
        if self._pool is not None:
            with self._cond:
                self._store = np.zeros(0, np.uint8)
                self._pool.close()

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _outcome(s: _Sampler, version: int) -> SamplerOutcome:
    ack = s.acks.get(version)
    if ack is None:
        status = SyncStatus.TIMEOUT if s.alive else SyncStatus.DISCONNECTED
        return SamplerOutcome(s.label, s.rank, status, s.transport, f"no answer ({status.value})")
    if ack.ok:
        return SamplerOutcome(s.label, s.rank, SyncStatus.OK, s.transport, None, ack.seconds, ack.moved)
    return SamplerOutcome(s.label, s.rank, SyncStatus.FAILED, s.transport, ack.error, ack.seconds, ack.moved)
