"""``TierSyncConnector``: vLLM's KV connector (``KVConnectorBase_V1``) backed by tiersync.

vLLM builds one instance per process role (scheduler, worker); each picks, once, the
implementation of its side and ``kv_role`` (:mod:`tiersync.integrations.vllm.roles`) and hands
every hook to it:

- ``kv_both``: host and disk offloading with prefix reuse across requests and restarts
  (:class:`OffloadScheduler` bookkeeping, :class:`OffloadWorker` bytes);
- ``kv_producer`` / ``kv_consumer``: prefill -> decode transfer, the decode side pulling each
  layer from the prefill side's KV server (:class:`PDScheduler`, :class:`PDWorker`).

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
from tiersync.integrations.vllm.pd_scheduler import PDScheduler
from tiersync.integrations.vllm.roles import (
    ConnectorRole,
    ConsumerWorkerRole,
    OffloadSchedulerRole,
    OffloadWorkerRole,
    PDSchedulerRole,
    ProducerWorkerRole,
)
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
    return CacheIdentity(
        model=cfg.model_id,
        weights_version=cfg.weights_version,
        kv_dtype=dtype,
        block_size=vllm_config.cache_config.block_size,
        layout_digest=layout,
    )


def _publishes_kv_events(vllm_config: VllmConfig) -> bool:
    """Whether vLLM publishes KV events (``--kv-events-config``): only then are the host and
    disk tiers' changes recorded and turned into events."""
    events = getattr(vllm_config, "kv_events_config", None)
    return bool(events is not None and events.enable_kv_cache_events)


def num_host_slots(kv_cache_config: Any, host_bytes: int) -> int:
    """How many blocks (all layers of one block id) fit in ``host_bytes`` per worker."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise UsageError(
            "one KV cache group (full attention) is supported", argument="kv_cache_config", groups=len(groups)
        )
    per_block = groups[0].kv_cache_spec.page_size_bytes * len(groups[0].layer_names)
    n = host_bytes // per_block
    if n < 1:
        raise UsageError(
            "host_bytes is smaller than one block of all layers",
            argument="kv_connector_extra_config.host_bytes",
            block_nbytes=per_block,
        )
    return n


class TierSyncConnector(KVConnectorBase_V1):
    """Host/disk offloading (``kv_both``) or prefill -> decode transfer (producer/consumer)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        self.config = ConnectorConfig.from_extra(tc.kv_connector_extra_config, vllm_config.model_config.model)
        self.impl: ConnectorRole = build_role(
            vllm_config,
            kv_cache_config,
            self.config,
            tc.kv_role,
            scheduler=role == KVConnectorRole.SCHEDULER,
            failure_policy=getattr(tc, "kv_load_failure_policy", "recompute"),
        )

    # -- worker side ----------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.impl.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.impl.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.impl.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self.impl.save_kv_layer(self._get_connector_metadata(), layer_name)

    def wait_for_save(self) -> None:
        self.impl.wait_for_save(self._get_connector_metadata())

    def weights_updated(self) -> None:
        """The model's weights changed (a weight-transfer update finished on this worker): the
        offloaded KV of the old weights is never loaded again; keys follow the new weights."""
        self.impl.weights_updated()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self.impl.get_transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.impl.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> WorkerReport | None:
        return self.impl.build_connector_worker_meta()

    def get_kv_connector_stats(self) -> TierSyncStats | None:
        """This half's hits, bytes and seconds since vLLM last asked (offloading; None for
        prefill -> decode)."""
        return self.impl.get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TierSyncStats:
        return TierSyncStats(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> TierSyncPromMetrics:
        return TierSyncPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        self.impl.shutdown()

    # -- scheduler side -------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return self.impl.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.impl.update_state_after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> StepMeta | PDMeta:
        return self.impl.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self.impl.update_connector_output(connector_output)

    def reset_cache(self) -> bool | None:
        """vLLM's ``reset_prefix_cache(reset_external=True)``: no block cached so far is hit again."""
        return self.impl.reset_cache()

    def take_events(self) -> list[Any]:
        """The host and disk tiers' BlockStored / BlockRemoved since the last step (vLLM
        publishes them with its own; see :mod:`tiersync.integrations.vllm.kv_events`)."""
        return self.impl.take_events()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.impl.request_finished(request, block_ids)


def build_role(
    vllm_config: VllmConfig,
    kv_cache_config: Any,
    cfg: ConnectorConfig,
    kv_role: str,
    *,
    scheduler: bool,
    failure_policy: str,
) -> ConnectorRole:
    """The implementation of this process side and ``kv_role`` (UsageError naming ``kv_role``)."""
    if kv_role in ("kv_producer", "kv_consumer"):
        producer = kv_role == "kv_producer"
        part = build_pd(vllm_config, kv_cache_config, cfg, producer=producer, scheduler=scheduler)
        if isinstance(part, PDScheduler):
            return PDSchedulerRole(part)
        return ProducerWorkerRole(part) if producer else ConsumerWorkerRole(part)
    if kv_role != "kv_both":
        raise UsageError("must be kv_both, kv_producer or kv_consumer", argument="kv_role", value=kv_role)
    if failure_policy != "recompute":
        log.warning(
            "kv_load_failure_policy=%r: a load tiersync refuses (a corrupt or missing block, "
            "KV of weights replaced since) fails its request instead of being recomputed; "
            "set kv_load_failure_policy='recompute'",
            failure_policy,
        )
    identity = cache_identity(vllm_config, cfg)
    slots = num_host_slots(kv_cache_config, cfg.host_bytes)
    if scheduler:
        return OffloadSchedulerRole(
            OffloadScheduler(
                identity=identity,
                num_slots=slots,
                policy=cfg.eviction,
                storage_dir=cfg.storage_dir,
                async_disk_loads=cfg.async_disk_loads,
                kv_events=_publishes_kv_events(vllm_config),
            )
        )
    return OffloadWorkerRole(
        OffloadWorker(
            identity=identity,
            num_slots=slots,
            rank=vllm_config.parallel_config.rank,
            storage_dir=cfg.storage_dir,
            transfer_workers=cfg.transfer_workers,
            timeout_s=cfg.load_timeout_s,
        ),
        kv_cache_config.num_blocks,
    )
