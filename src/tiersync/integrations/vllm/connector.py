"""``TierSyncConnector``: vLLM's KV connector (``KVConnectorBase_V1``) backed by tiersync.

vLLM builds one instance per role; this class only routes each hook to the role's own
object: :class:`OffloadScheduler` (bookkeeping, in the scheduler process) or
:class:`OffloadWorker` (bytes, in each worker process). Use it with::

    KVTransferConfig(kv_connector="TierSyncConnector", kv_role="kv_both",
                     kv_connector_module_path="tiersync.integrations.vllm",
                     kv_connector_extra_config={"host_bytes": "4GiB", "storage_dir": "/nvme/kv"},
                     kv_load_failure_policy="recompute")

With ``kv_load_failure_policy="recompute"`` a block that fails to load (a corrupt disk copy,
a failed save) is recomputed by vLLM; with vLLM's default ("fail") the request fails.

Settings: :mod:`tiersync.integrations.vllm.config`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from tiersync.errors import UsageError
from tiersync.integrations.vllm.config import ConnectorConfig
from tiersync.integrations.vllm.metadata import StepMeta, WorkerReport
from tiersync.integrations.vllm.scheduler import OffloadScheduler
from tiersync.integrations.vllm.worker import OffloadWorker
from tiersync.store.keys import CacheIdentity

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["TierSyncConnector", "cache_identity", "num_host_slots"]


def cache_identity(vllm_config: "VllmConfig", cfg: ConnectorConfig) -> CacheIdentity:
    """The namespace of this engine's blocks: equal only for interchangeable KV."""
    par = vllm_config.parallel_config
    dtype = f"{vllm_config.cache_config.cache_dtype}/{vllm_config.model_config.dtype}"
    layout = f"tp{par.tensor_parallel_size}-pp{par.pipeline_parallel_size}".encode()
    return CacheIdentity(model=cfg.model_id, weights_version=cfg.weights_version, kv_dtype=dtype,
                         block_size=vllm_config.cache_config.block_size, layout_digest=layout)


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
    """Host (and disk) KV offloading with prefix reuse across requests and restarts."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        if tc.kv_role != "kv_both":
            raise UsageError("this connector build offloads (kv_role='kv_both')", argument="kv_role",
                             value=tc.kv_role)
        self.config = ConnectorConfig.from_extra(tc.kv_connector_extra_config, vllm_config.model_config.model)
        identity = cache_identity(vllm_config, self.config)
        slots = num_host_slots(kv_cache_config, self.config.host_bytes)
        self._sched: OffloadScheduler | None = None
        self._worker: OffloadWorker | None = None
        self._num_blocks = kv_cache_config.num_blocks
        if role == KVConnectorRole.SCHEDULER:
            self._sched = OffloadScheduler(identity=identity, num_slots=slots, policy=self.config.eviction,
                                           storage_dir=self.config.storage_dir)
        else:
            rank = vllm_config.parallel_config.rank
            self._worker = OffloadWorker(identity=identity, num_slots=slots, rank=rank,
                                         storage_dir=self.config.storage_dir,
                                         transfer_workers=self.config.transfer_workers,
                                         timeout_s=self.config.load_timeout_s)

    # -- worker side ----------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker.register(kv_caches, self._num_blocks)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, StepMeta) and meta.loads:
            self._worker.start_loads(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole-step saves in wait_for_save: a CPU "device" copy is one memcpy per block

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, StepMeta):
            self._worker.run_saves(meta.saves)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> WorkerReport | None:
        return self._worker.take_report() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # -- scheduler side -------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return self._sched.num_new_matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._sched.after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> StepMeta:
        return self._sched.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._sched.on_report(getattr(connector_output, "kv_connector_worker_meta", None))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._sched.finished(request)
        return False, None
