"""The connector's implementations, one per vLLM process side and ``kv_role``.

vLLM builds a connector in the scheduler process and one in every worker; ``kv_role`` says what
it does. :func:`build_role` picks once which of these answers every hook:

=================  ==========================  =========================
``kv_role``        scheduler                   worker
=================  ==========================  =========================
``kv_both``        :class:`OffloadSchedulerRole` :class:`OffloadWorkerRole`
``kv_producer``    :class:`PDSchedulerRole`      :class:`ProducerWorkerRole`
``kv_consumer``    :class:`PDSchedulerRole`      :class:`ConsumerWorkerRole`
=================  ==========================  =========================

:class:`ConnectorRole` is their base: every hook with what a side that has nothing to do answers
(vLLM calls scheduler hooks only on the scheduler's connector, worker hooks only on workers').
Each implementation holds exactly the typed object of its side and reads its own metadata type.
"""

from __future__ import annotations

from typing import Any, TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from tiersync.errors import UsageError
from tiersync.integrations.vllm.metadata import PDMeta, StepMeta, WorkerReport
from tiersync.integrations.vllm.pd_scheduler import PDScheduler
from tiersync.integrations.vllm.pd_worker import PDWorker
from tiersync.integrations.vllm.scheduler import OffloadScheduler
from tiersync.integrations.vllm.stats import TierSyncStats
from tiersync.integrations.vllm.worker import OffloadWorker

__all__ = [
    "ConnectorRole",
    "ConsumerWorkerRole",
    "OffloadSchedulerRole",
    "OffloadWorkerRole",
    "PDSchedulerRole",
    "ProducerWorkerRole",
]

M = TypeVar("M", StepMeta, PDMeta)


def _expect(meta: object, kind: type[M]) -> M:
    if not isinstance(meta, kind):
        raise UsageError(
            f"connector metadata of another kv_role: expected {kind.__name__}",
            argument="metadata",
            got=type(meta).__name__,
        )
    return meta


class ConnectorRole:
    """Every hook tiersync answers, with the answer of a side that has nothing to do."""

    # -- worker hooks ----------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        return None

    def start_load_kv(self, meta: object) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, meta: object, layer_name: str) -> None:
        return None

    def wait_for_save(self, meta: object) -> None:
        return None

    def weights_updated(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return KVConnectorTransferResults()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def build_connector_worker_meta(self) -> WorkerReport | None:
        return None

    def get_kv_connector_stats(self) -> TierSyncStats | None:
        return None

    def shutdown(self) -> None:
        return None

    # -- scheduler hooks -------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> StepMeta | PDMeta:
        return StepMeta()

    def update_connector_output(self, connector_output: Any) -> None:
        return None

    def reset_cache(self) -> bool | None:
        return None

    def take_events(self) -> list[Any]:
        return []

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, None


class OffloadSchedulerRole(ConnectorRole):
    """``kv_both``, scheduler: which blocks are on host or disk, what to load and save each step."""

    def __init__(self, sched: OffloadScheduler) -> None:
        self.sched = sched

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return self.sched.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        self.sched.after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> StepMeta:
        return self.sched.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self.sched.loads_finished(getattr(connector_output, "finished_recving", None))
        self.sched.on_report(getattr(connector_output, "kv_connector_worker_meta", None))

    def reset_cache(self) -> bool:
        """No block cached so far is hit again (vLLM's ``reset_prefix_cache(reset_external=True)``)."""
        return self.sched.reset()

    def take_events(self) -> list[Any]:
        return self.sched.take_events()

    def get_kv_connector_stats(self) -> TierSyncStats | None:
        return self.sched.take_stats()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.sched.finished(request)
        return False, None


class OffloadWorkerRole(ConnectorRole):
    """``kv_both``, worker: the bytes of the scheduler's loads and saves."""

    def __init__(self, worker: OffloadWorker, num_blocks: int) -> None:
        self.worker, self.num_blocks = worker, num_blocks

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.worker.register(kv_caches, self.num_blocks)

    def start_load_kv(self, meta: object) -> None:
        step = _expect(meta, StepMeta)
        if step.loads:
            self.worker.start_loads(step.loads, step.generation)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_layer(layer_name)

    def wait_for_save(self, meta: object) -> None:
        # saves go in here, whole steps at once: a CPU "device" copy is one memcpy per block
        step = _expect(meta, StepMeta)
        self.worker.run_saves(step.saves, step.generation)

    def weights_updated(self) -> None:
        self.worker.weights_updated()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return KVConnectorTransferResults(finished_recving=self.worker.finished_loads() or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    def build_connector_worker_meta(self) -> WorkerReport | None:
        return self.worker.take_report()

    def get_kv_connector_stats(self) -> TierSyncStats | None:
        return self.worker.take_stats()

    def shutdown(self) -> None:
        self.worker.close()


class PDSchedulerRole(ConnectorRole):
    """``kv_producer`` / ``kv_consumer``, scheduler: what the prefill side offers and where the
    decode side reads it."""

    def __init__(self, sched: PDScheduler) -> None:
        self.sched = sched

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return self.sched.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        self.sched.after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> PDMeta:
        return self.sched.build_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.sched.finished(request)

    def shutdown(self) -> None:
        self.sched.close()


class _PDWorkerRole(ConnectorRole):
    def __init__(self, worker: PDWorker) -> None:
        self.worker = worker

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.worker.register(kv_caches)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sent, received, failed = self.worker.results(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=received, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    def shutdown(self) -> None:
        self.worker.close()


class ProducerWorkerRole(_PDWorkerRole):
    """``kv_producer``, worker: serves each finished prompt's KV, layer by layer as it is written."""

    def start_load_kv(self, meta: object) -> None:
        meta = _expect(meta, PDMeta)
        self.worker.drop_sends(meta.aborts)  # before this step's forward writes their blocks
        self.worker.start_sends(meta.sends)

    def save_kv_layer(self, meta: object, layer_name: str) -> None:
        sends = _expect(meta, PDMeta).sends
        if sends:  # this layer's KV is written: serve it now
            self.worker.start_sends(sends)
            self.worker.layer_done(layer_name)

    def wait_for_save(self, meta: object) -> None:
        sends = _expect(meta, PDMeta).sends
        if sends:
            self.worker.start_sends(sends)
            self.worker.all_layers_done()


class ConsumerWorkerRole(_PDWorkerRole):
    """``kv_consumer``, worker: pulls each request's KV from the prefill side into its blocks."""

    def start_load_kv(self, meta: object) -> None:
        self.worker.start_reads(_expect(meta, PDMeta).reads)
