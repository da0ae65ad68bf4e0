"""The trainer side: one :class:`WeightPublisher` per trainer shard (source rank).

It owns the shard's named tensors (numpy, torch or JAX; any device) and one version buffer
(:mod:`~tiersync.weights.publish_buffer`): a ``/dev/shm`` segment when
:attr:`PublisherConfig.shm` (same-host samplers read it in place: one write, many readers) or
anonymous memory. :meth:`WeightPublisher.publish` runs, in order on one worker thread:
announce version v to every registered sampler (:mod:`~tiersync.weights.sampler_registry`),
copy each tensor D2H into the buffer and tell the shared-memory samplers it is ready (so they
copy tensor i while i+1 is being written; a TCP sampler's GET waits for it on the trainer), then
wait for every sampler's answer. The returned future's
:class:`PublishResult` has one :class:`SamplerOutcome` per sampler; a sampler that dies or
times out fails only its own outcome. A sampler that registers again (same label) replaces
its old registration and takes part from the next publish on; samplers of one destination
rank under other labels (the same worker of several engines) all take part, each told the
relay of one of them per rank.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from tiersync.errors import ClosedError, UsageError
from tiersync.net.server import TcpServer
from tiersync.weights.config import PublisherConfig, TransportKind
from tiersync.weights.manifest import Manifest, host_id
from tiersync.weights.ops import Announce, Ready
from tiersync.weights.publish_buffer import PublishBuffer
from tiersync.weights.publish_result import PublishResult, SamplerOutcome
from tiersync.weights.sampler_registry import Sampler, SamplerRegistry
from tiersync.weights.segment import SEGMENT_PREFIX, SegmentPool, tensor_offsets
from tiersync.weights.serving import SpanService
from tiersync.weights.sharding import Sharding, local_shape
from tiersync.weights.tensors import host_bytes, tensor_spec
from tiersync.weights.transfer_plan import PlanOptions
from tiersync.weights.validate import validate_source

__all__ = ["PublishResult", "SamplerOutcome", "WeightPublisher"]

_ANNOUNCERS = 16  # ANNOUNCEs sent at once


class WeightPublisher:
    """Publishes ``tensors`` (this shard's local tensors, in write order) as source rank ``rank``.

    ``layout``: a :class:`Sharding` for every tensor or a mapping name -> sharding; every mesh
    must number its ranks ``0..n-1`` (samplers index publishers by source rank).
    ``global_shapes``: name -> global shape; by default the local shape times the shard count
    per dimension (refused when that does not reproduce the local shape). Raises
    :class:`UsageError` naming the argument; nothing is started then.
    """

    def __init__(
        self,
        tensors: Mapping[str, Any],
        layout: Sharding | Mapping[str, Sharding],
        *,
        rank: int = 0,
        config: PublisherConfig | None = None,
        global_shapes: Mapping[str, tuple[int, ...]] | None = None,
    ):
        self.config = config or PublisherConfig()
        if not isinstance(self.config, PublisherConfig):
            raise UsageError("expected a PublisherConfig", argument="config")
        self.rank = rank
        self._names, self._specs, self._source = validate_source(tensors, layout, rank, global_shapes)
        self._tensors = dict(tensors)
        self._local = [
            int(np.prod(local_shape(s.shape, sh, rank))) * s.itemsize for s, sh in zip(self._specs, self._source)
        ]
        self._offsets, payload = tensor_offsets(self._local)
        self.nbytes = sum(self._local)
        self._host = host_id()
        self.incarnation = secrets.randbits(63) + 1
        """This publisher's random id, in every manifest: GETs naming another are refused."""
        self._payload = payload
        self._pool: SegmentPool | None = None
        if self.config.shm:
            path = os.path.join(self.config.shm_dir, f"{SEGMENT_PREFIX}{os.getpid()}-{rank}-{secrets.token_hex(4)}")
            self._pool = SegmentPool(path, payload)
        self._cond = threading.Condition()  # the buffer's, the registry's and the pool's lock
        index = {n: i for i, n in enumerate(self._names)}
        self._buffer = PublishBuffer(self._cond, self._pool, index, self._offsets, self._local, payload)
        self._registry = SamplerRegistry(
            self._cond, self._pool, self._host, rank, self.config.io_timeout_s, self.incarnation
        )
        self._last_version: int | None = None
        self._closed = False
        self._worker = ThreadPoolExecutor(1, thread_name_prefix=f"publish-{rank}")
        # ANNOUNCEs go out in parallel: a sampler that stopped reading its control channel costs
        # a publish io_timeout_s once (then it is dropped), not io_timeout_s per such sampler
        self._announcer = ThreadPoolExecutor(_ANNOUNCERS, thread_name_prefix=f"announce-{rank}")
        service = SpanService(
            self._buffer.provide,
            self.config.io_timeout_s,
            control=self._registry.control,
            ended=self._registry.ended,
            summer=self._buffer.span_sum,
            pinned=True,  # a version is written over once every sampler acknowledged it, timed out or left
            serving=self._buffer.serving,
            incarnation=self.incarnation,
        )
        self._server = TcpServer(self.config.listen, service, self.config.tcp_config(f"weights-publisher-{rank}"))

    @property
    def address(self) -> str:
        """The "host:port" samplers connect to (give it to ``ReceiverConfig.publishers``)."""
        return self._server.address

    @property
    def segment_path(self) -> str | None:
        return self._buffer.segment_path

    def samplers(self) -> dict[str, int]:
        """Registered, connected samplers: label -> destination rank."""
        return self._registry.labels()

    def wait_for_samplers(self, count: int, timeout: float) -> None:
        """Block until ``count`` samplers are registered; NetTimeoutError after ``timeout`` seconds."""
        self._registry.wait_for(count, timeout, self.address)

    # -- publishing ------------------------------------------------------------
    def publish(self, version: int, tensors: Mapping[str, Any] | None = None) -> Future[PublishResult]:
        """Send version ``version`` (an int above every earlier one) to every registered sampler.

        ``tensors``: replacement objects (same names, shapes, dtypes) to read from now on, e.g.
        new JAX arrays; None re-reads the registered ones (updated in place by training).
        Publishes run one at a time in call order. The future fails only for a local error
        (the trainer's tensors could not be read, a manifest over ``max_meta_bytes``: no sampler
        is dropped for it), or is cancelled when :meth:`close` came before it began; sampler
        failures are in the result.
        """
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise UsageError("must be an int >= 0", argument="version", value=version)
        replace = self._check_replacement(tensors)
        with self._cond:
            if self._closed:
                raise ClosedError("publisher closed", argument="publisher")
            if self._last_version is not None and version <= self._last_version:
                raise UsageError(
                    "must exceed the last published version", argument="version", value=version, last=self._last_version
                )
            self._last_version = version
            if replace:
                self._tensors.update(replace)
            return self._worker.submit(self._run, version)  # under the lock: close() shuts it after

    def _check_replacement(self, tensors: Mapping[str, Any] | None) -> dict[str, Any]:
        if tensors is None:
            return {}
        if not isinstance(tensors, Mapping):
            raise UsageError("expected a mapping name -> tensor", argument="tensors")
        for name, t in tensors.items():
            if name not in self._names:
                raise UsageError(f"unknown tensor {name!r}", argument="tensors")
            i = self._names.index(name)
            if tensor_spec(t, "tensors") != (
                local_shape(self._specs[i].shape, self._source[i], self.rank),
                self._specs[i].dtype,
            ):
                raise UsageError(f"tensor {name!r} changed shape or dtype", argument="tensors")
        return dict(tensors)

    def _run(self, version: int) -> PublishResult:
        t0 = time.perf_counter()
        targets = self._registry.live()
        holders: set[object] = {s for s in targets if s.zc}
        self._buffer.begin(version, holders, self.config.io_timeout_s)
        announce = Announce(self._manifest(version, targets))
        if len(announce.meta()) > self.config.max_meta_bytes:  # this side's limit: no sampler's fault
            self._buffer.abandon(version, holders)
            raise UsageError(f"the manifest of version {version} exceeds max_meta_bytes", argument="max_meta_bytes")
        list(self._announcer.map(lambda s: self._registry.send(s, announce), targets))
        shm = [
            s for s in targets if s.transport is TransportKind.SHM
        ]  # TCP GETs are parked until their part is written
        for i, name in enumerate(self._names):
            self._buffer.write(i, host_bytes(self._tensors[name], name))
            for s in shm:
                if s.alive:
                    self._registry.send(s, Ready(version, i + 1))
        self._buffer.complete(version)
        outcomes = self._registry.collect(version, targets, self.config.publish_timeout_s)
        return PublishResult(version, outcomes, time.perf_counter() - t0, self.nbytes)

    def _manifest(self, version: int, targets: list[Sampler]) -> Manifest:
        opts = PlanOptions(self.config.fanout, self.config.segment_bytes)
        return Manifest(
            version,
            self.rank,
            self._source[0].mesh.size,
            tuple(self._names),
            tuple(self._specs),
            tuple(self._source),
            tuple(self._offsets),
            self._payload,
            self._buffer.segment_path,
            self._host,
            opts,
            {s.rank: s.relay for s in targets if s.relay},
            self.incarnation,
        )

    def close(self) -> None:
        """Stop serving, drop the samplers, unlink the segment; idempotent. A publish running
        stops waiting for answers (its result says who had not answered); the queued ones are
        cancelled."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            samplers = self._registry.stop()
        self._worker.shutdown(wait=True, cancel_futures=True)
        self._announcer.shutdown(wait=True)
        self._server.close()
        for s in samplers:
            self._registry.drop(s)
        self._buffer.close()

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
