"""The scheduler's half of the connector: which blocks of which request are hits, which
new blocks to offload, and into which host slots (an :class:`OffloadManager`).

Keys are chained xxh3-128 block keys of the request's prompt tokens under the engine's
:class:`CacheIdentity` (model, weights version, dtypes, block size, parallel layout),
mixed with the request's LoRA name, cache salt and multimodal hashes. Only full prompt
blocks are offloaded; at least one prompt token is always left to compute.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from dataclasses import dataclass, field
from typing import Any

from tiersync.integrations.vllm.kv_events import KVEventLog
from tiersync.integrations.vllm.metadata import LoadJob, SaveJob, StepMeta, WorkerReport
from tiersync.integrations.vllm.request_inputs import request_extras
from tiersync.integrations.vllm.stats import StatsCounter, TierSyncStats
from tiersync.store.keys import CacheIdentity, block_keys
from tiersync.store.offload import LoadSpec, OffloadConfig, OffloadManager
from tiersync.tiers.storage import StorageConfig, StorageTier

__all__ = ["OffloadScheduler"]


@dataclass(slots=True)
class _Tracked:
    request: Any
    keys: list[bytes]
    block_ids: list[int] = field(default_factory=list)
    load: LoadSpec | None = None  # pinned hits waiting for their blocks
    load_start: int = 0
    load_ready: tuple[int, ...] | None = None  # device blocks, once allocated
    load_background: bool = False  # the load reads disk: vLLM loads it asynchronously
    offloaded: int = 0  # leading prompt blocks already cached (hit or saved)


class OffloadScheduler:
    """Request bookkeeping for ``kv_both`` offloading (host and disk)."""

    def __init__(
        self,
        *,
        identity: CacheIdentity,
        num_slots: int,
        policy: str,
        storage_dir: str | None,
        async_disk_loads: bool = True,
        kv_events: bool = False,
    ) -> None:
        self.identity, self.async_disk_loads = identity, async_disk_loads
        self._base_identity, self.generation, self._resets = identity, 0, 0
        self._nonce = secrets.token_hex(8)  # re-keyed namespaces of this process are its own
        self.block_size = identity.block_size
        self.manager = OffloadManager(OffloadConfig(num_slots, policy, storage_dir is not None, kv_events))
        self._events = KVEventLog(self.block_size) if kv_events else None
        self._reqs: dict[str, _Tracked] = {}
        self._loading: dict[str, list[bytes]] = {}  # background loads: pinned until the worker is done
        self.hit_blocks = {"host": 0, "disk": 0}
        self._stats = StatsCounter()
        if storage_dir is not None:
            self._scan(storage_dir)

    def _scan(self, storage_dir: str) -> None:
        """Index what an earlier engine left on disk (rank 0's directory stands for all)."""
        cfg = StorageConfig(directory=os.path.join(storage_dir, "rank0"), identity=self.identity.digest())
        with StorageTier(cfg) as tier:
            self.manager.add_storage(tier.keys())

    def _track(self, request: Any) -> _Tracked:
        t = self._reqs.get(request.request_id)
        if t is None:
            t = self._reqs[request.request_id] = _Tracked(request, self._keys(request))
        return t

    def _keys(self, request: Any) -> list[bytes]:
        return block_keys(list(request.prompt_token_ids or ()), self.identity, request_extras(request))

    def _drop_load(self, t: _Tracked) -> None:
        if t.load is not None and len(t.load):
            self.manager.release(t.load.keys)
        t.load, t.load_ready = None, None

    # -- vLLM scheduler hooks -------------------------------------------------------
    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens past ``num_computed_tokens`` this cache can load now (block multiple), and
        whether vLLM should load them asynchronously: a load that reads disk runs in the
        background (the request waits for it, the batch does not); host hits are one memcpy,
        done before the forward. The hits stay pinned until the worker has read them."""
        t = self._track(request)
        self._drop_load(t)
        # blocks vLLM serves from its own prefix cache are never saved: an earlier request
        # computed (and saved) them, maybe under weights this engine no longer has
        t.offloaded = max(t.offloaded, num_computed_tokens // self.block_size)
        if request.request_id in self._loading:  # its background load is still running
            return 0, False
        usable = max(0, (request.num_tokens - 1) // self.block_size)  # keep >= 1 token to compute
        start = num_computed_tokens // self.block_size
        if start >= min(usable, len(t.keys)):
            return 0, False
        spec = self.manager.prepare_load(t.keys[start:usable])
        if not len(spec):
            return 0, False
        t.load, t.load_start = spec, start
        if self._events is not None:  # blocks found on disk at startup get their token ids here
            self._events.learn(request, enumerate(spec.keys, start))
        t.load_background = self.async_disk_loads and any(spec.from_storage)
        return len(spec) * self.block_size, t.load_background

    def after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        t = self._reqs.get(request.request_id)
        if t is None or t.load is None:
            return
        n = min(len(t.load), num_external_tokens // self.block_size)
        if n < len(t.load):  # the scheduler took fewer tokens than offered
            self.manager.release(t.load.keys[n:])
            t.load = LoadSpec(t.load.keys[:n], t.load.slots[:n], t.load.from_storage[:n])
        if n == 0:
            t.load = None
            return
        t.load_ready = tuple(block_ids[t.load_start : t.load_start + n])

    def build_meta(self, out: Any) -> StepMeta:
        meta = StepMeta(generation=self.generation)
        for t in self._reqs.values():
            if t.load is not None and t.load_ready is not None:
                rid = t.request.request_id
                meta.loads.append(LoadJob(rid, t.load, t.load_ready, t.load_background))
                self._count_hits(t.load)
                t.offloaded = max(t.offloaded, t.load_start + len(t.load))
                if t.load_background:  # slots stay pinned until the worker reports the request
                    self._loading[rid] = list(t.load.keys)
                else:  # the worker copies before the forward, before any later spec's save
                    self.manager.release(t.load.keys)
                t.load, t.load_ready = None, None
        for req in out.scheduled_new_reqs:
            t = self._reqs.get(req.req_id)
            if t is not None:
                t.block_ids = list(req.block_ids[0])
                self._plan_save(meta, t, req.num_computed_tokens + out.num_scheduled_tokens[req.req_id])
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            t = self._reqs.get(rid)
            if t is None:
                continue
            new = cached.new_block_ids[i]
            if new is not None:
                t.block_ids = list(new[0]) if rid in cached.resumed_req_ids else t.block_ids + list(new[0])
            self._plan_save(meta, t, cached.num_computed_tokens[i] + out.num_scheduled_tokens[rid])
        return meta

    def _count_hits(self, spec: LoadSpec) -> None:
        disk = sum(spec.from_storage)
        self.hit_blocks["disk"] += disk
        self.hit_blocks["host"] += len(spec) - disk
        self._stats.add("hit_tokens_disk", disk * self.block_size)
        self._stats.add("hit_tokens_host", (len(spec) - disk) * self.block_size)

    def take_events(self) -> list[Any]:
        """vLLM KV events for the host and disk tiers since the last call (empty unless vLLM
        publishes KV events)."""
        if self._events is None:
            return []
        return self._events.events(self.manager.take_changes())

    def take_stats(self) -> TierSyncStats | None:
        """Hit tokens per tier since the last call (vLLM's ``get_kv_connector_stats``)."""
        return self._stats.take()

    def _plan_save(self, meta: StepMeta, t: _Tracked, computed: int) -> None:
        full = min(computed // self.block_size, len(t.keys), len(t.block_ids))
        if full <= t.offloaded:
            return
        keys = t.keys[t.offloaded : full]
        position = {k: t.offloaded + i for i, k in enumerate(keys)}
        spec = self.manager.prepare_store(keys)
        t.offloaded = full  # blocks that found no slot are not retried
        if len(spec):
            if self._events is not None:
                self._events.learn(t.request, ((position[k], k) for k in spec.keys))
            devs = tuple(t.block_ids[position[k]] for k in spec.keys)
            meta.saves.append(SaveJob(t.request.request_id, spec, devs))

    def loads_finished(self, req_ids: set[str] | None) -> None:
        """The workers finished these requests' background loads: unpin their slots."""
        for rid in req_ids or ():
            keys = self._loading.pop(rid, None)
            if keys:
                self.manager.release(keys)

    def on_report(self, report: WorkerReport | None) -> None:
        if report is None:
            return
        self.manager.invalidate(report.bad_slots)
        self.manager.invalidate(report.bad_disk, storage=True)
        self.manager.storage_done(report.stored_ok, report.stored_failed)
        if report.generation > self.generation:
            self.generation = report.generation
            self._rekey()

    def reset(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_external=True)``: forget every cached block (from
        now on no key matches one cached before). True: done."""
        self._resets += 1
        self._rekey()
        return True

    def _rekey(self) -> None:
        """A new key namespace (the identity's weights version gets ``+<nonce>.g<weights
        generation>.r<resets>``; the nonce is this process's, so no later engine on the same disk
        tier ever reuses it for other weights): blocks cached under the old keys are never hit
        again and age out of the tiers (routers are told they are gone). Hits planned under the
        old keys and not yet sent are dropped; the workers refuse those already sent when the
        weights changed. Requests tracked now save nothing more: part of their KV may come
        from the old weights."""
        version = f"{self._base_identity.weights_version}+{self._nonce}.g{self.generation}.r{self._resets}"
        self.identity = dataclasses.replace(self._base_identity, weights_version=version)
        if self._events is not None:
            self._events.retire_all()
        for t in self._reqs.values():
            self._drop_load(t)
            t.keys = self._keys(t.request)
            t.offloaded = len(t.keys)

    def finished(self, request: Any) -> None:
        t = self._reqs.pop(request.request_id, None)
        if t is not None:
            self._drop_load(t)
