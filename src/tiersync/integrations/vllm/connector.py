"""``TierSyncConnector``: vLLM's KV connector (``KVConnectorBase_V1``) backed by tiersync.

vLLM builds one instance per process role (scheduler, worker); this class only routes
each hook to the object of that role and of the ``kv_role``:

- ``kv_both``: :class:`OffloadScheduler` (bookkeeping) / :class:`OffloadWorker` (bytes):
  host and disk offloading with prefix reuse across requests and restarts;
- ``kv_producer`` / ``kv_consumer``: :class:`PDScheduler` / :class:`PDWorker`: prefill ->
  decode transfer, the decode side pulling each layer from the prefill side's KV server.

Offloading::

    KVTransferConfig(kv_connector="TierSyncConnector", kv_role="kv_both",
                     kv_connector_module_path="tiersync.integrations.vllm",
                     kv_connector_extra_config={"host_bytes": "4GiB", "storage_dir": "/nvme/kv"},
                     kv_load_failure_policy="recompute")

With ``kv_load_failure_policy="recompute"`` a block that fails to load (a corrupt disk copy,
a failed save) is recomputed by vLLM; with vLLM's default ("fail") the request fails.

Settings: :mod:`tiersync.integrations.vllm.config`. Hits per tier, bytes moved and load and
save seconds reach vLLM's stats log and the OpenAI server's ``/metrics``
(:mod:`tiersync.integrations.vllm.stats`).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from tiersync.errors import UsageError
from tiersync.integrations.vllm.config import ConnectorConfig
from tiersync.integrations.vllm.metadata import PDMeta, StepMeta, WorkerReport
from tiersync.integrations.vllm.pd import build_pd
from tiersync.integrations.vllm.scheduler import OffloadScheduler
from tiersync.integrations.vllm.stats import TierSyncPromMetrics, TierSyncStats
from tiersync.integrations.vllm.worker import OffloadWorker
from tiersync.store.keys import CacheIdentity

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)

__all__ = ["TierSyncConnector", "cache_identity", "num_host_slots"]


def cache_identity(vllm_config: VllmConfig, cfg: ConnectorConfig) -> CacheIdentity:
    """The namespace of this engine's blocks: equal only for interchangeable KV."""
    par = vllm_config.parallel_config
    dtype = f"{vllm_config.cache_config.cache_dtype}/{vllm_config.model_config.dtype}"
    layout = f"tp{par.tensor_parallel_size}-pp{par.pipeline_parallel_size}".encode()
    return CacheIdentity(model=cfg.model_id, weights_version=cfg.weights_version, kv_dtype=dtype,
                         block_size=vllm_config.cache_config.block_size, layout_digest=layout)


def _publishes_kv_events(vllm_config: VllmConfig) -> bool:
    """Whether vLLM publishes KV events (``--kv-events-config``): only then are the host and
    disk tiers' changes recorded and turned into events."""
    events = getattr(vllm_config, "kv_events_config", None)
    return bool(events is not None and events.enable_kv_cache_events)


def num_host_slots(kv_cache_config: Any, host_bytes: int) -> int:
    """How many blocks (all layers of one block id) fit in ``host_bytes`` per worker."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise UsageError("one KV cache group (full attention) is supported", argument="kv_cache_config",
                         groups=len(groups))
    per_block = groups[0].kv_cache_spec.page_size_bytes * len(groups[0].layer_names)
    n = host_bytes // per_block
    if n < 1:
        raise UsageError("host_bytes is smaller than one block of all layers",
                         argument="kv_connector_extra_config.host_bytes", block_nbytes=per_block)
    return n


class TierSyncConnector(KVConnectorBase_V1):
    """Host/disk offloading (``kv_both``) or prefill -> decode transfer (producer/consumer)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        self.config = ConnectorConfig.from_extra(tc.kv_connector_extra_config, vllm_config.model_config.model)
        self._sched: Any = None
        self._worker: Any = None
        self._num_blocks = kv_cache_config.num_blocks
        scheduler = role == KVConnectorRole.SCHEDULER
        if tc.kv_role in ("kv_producer", "kv_consumer"):
            self._pd = True
            part = build_pd(vllm_config, kv_cache_config, self.config, producer=tc.kv_role == "kv_producer",
                            scheduler=scheduler)
            self._sched, self._worker = (part, None) if scheduler else (None, part)
            return
        if tc.kv_role != "kv_both":
            raise UsageError("must be kv_both, kv_producer or kv_consumer", argument="kv_role", value=tc.kv_role)
        self._pd = False
        if getattr(tc, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning("kv_load_failure_policy=%r: a load tiersync refuses (a corrupt or missing block, "
                        "KV of weights replaced since) fails its request instead of being recomputed; "
                        "set kv_load_failure_policy='recompute'", tc.kv_load_failure_policy)
        identity = cache_identity(vllm_config, self.config)
        slots = num_host_slots(kv_cache_config, self.config.host_bytes)
        if scheduler:
            self._sched = OffloadScheduler(identity=identity, num_slots=slots, policy=self.config.eviction,
                                           storage_dir=self.config.storage_dir,
                                           async_disk_loads=self.config.async_disk_loads,
                                           kv_events=_publishes_kv_events(vllm_config))
        else:
            self._worker = OffloadWorker(identity=identity, num_slots=slots, rank=vllm_config.parallel_config.rank,
                                         storage_dir=self.config.storage_dir,
                                         transfer_workers=self.config.transfer_workers,
                                         timeout_s=self.config.load_timeout_s)

    # -- worker side ----------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self._pd:
            self._worker.register(kv_caches)
        else:
            self._worker.register(kv_caches, self._num_blocks)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, StepMeta) and meta.loads:
            self._worker.start_loads(meta.loads, meta.generation)
        elif isinstance(meta, PDMeta):
            self._worker.start_reads(meta.reads)
            self._worker.start_sends(meta.sends)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._pd:
            self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, PDMeta) and meta.sends:  # this layer's KV is written: serve it now
            self._worker.start_sends(meta.sends)
            self._worker.layer_done(layer_name)
        # offloading saves whole steps in wait_for_save: a CPU "device" copy is one memcpy per block

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, StepMeta):
            self._worker.run_saves(meta.saves)
        elif isinstance(meta, PDMeta) and meta.sends:
            self._worker.start_sends(meta.sends)
            self._worker.all_layers_done()

    def weights_updated(self) -> None:
        """The model's weights changed (a weight-transfer update finished on this worker): the
        offloaded KV of the old weights is never loaded again; keys follow the new weights."""
        if self._worker is not None and not self._pd:
            self._worker.weights_updated()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if not self._pd:
            return KVConnectorTransferResults(finished_recving=self._worker.finished_loads() or None)
        sent, received, failed = self._worker.results(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=received, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> WorkerReport | None:
        return self._worker.take_report() if self._worker is not None and not self._pd else None

    def get_kv_connector_stats(self) -> TierSyncStats | None:
        """This half's hits, bytes and seconds since vLLM last asked (offloading; None for
        prefill -> decode)."""
        part = self._worker if self._worker is not None else self._sched
        return None if self._pd or part is None else part.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TierSyncStats:
        return TierSyncStats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> TierSyncPromMetrics:
        return TierSyncPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # -- scheduler side -------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return self._sched.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._sched.after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        return self._sched.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        if not self._pd:
            self._sched.loads_finished(getattr(connector_output, "finished_recving", None))
            self._sched.on_report(getattr(connector_output, "kv_connector_worker_meta", None))

    def reset_cache(self) -> bool | None:
        """vLLM's ``reset_prefix_cache(reset_external=True)``: no block cached so far is hit again."""
        return None if self._pd or self._sched is None else self._sched.reset()

    def take_events(self) -> list[Any]:
        """The host and disk tiers' BlockStored / BlockRemoved since the last step (vLLM
        publishes them with its own; see :mod:`tiersync.integrations.vllm.kv_events`)."""
        return [] if self._pd or self._sched is None else self._sched.take_events()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._pd:
            return self._sched.finished(request)
        self._sched.finished(request)
        return False, None
