"""tiersync as a vLLM weight-transfer backend: the worker side (``WeightTransferEngine``).

RL users select it as any of vLLM's backends and drive it with vLLM's own control plane::

    python -m vllm.entrypoints.openai.api_server --model M --weight-transfer-config '{"backend": "tiersync"}'
    # (VLLM_SERVER_DEV_MODE=1 exposes vLLM's /init_weight_transfer_engine, /start_weight_update,
    #  /update_weights and /finish_weight_update routes; LLM(...) has the same methods)

The trainer side (:mod:`tiersync.integrations.vllm.weight_trainer`) runs a
:class:`~tiersync.weights.WeightPublisher` and drives the four calls. ``init_info`` is a
:class:`~tiersync.integrations.vllm.weight_sync.WeightSyncConfig` dict (``publishers``,
``transport``, ``token``, ...): each worker starts a :class:`~tiersync.weights.WeightReceiver`
that follows the trainer in the background (shared memory on the trainer's host, else TCP;
resharding, dedup and tree fan-out as for any receiver). ``update_info`` is ``{"version": v}``:
the worker waits until version ``v`` (or a later one) has landed and loads it through vLLM's
layerwise reload (``start_weight_update`` ... ``finish_weight_update``), holding the version's
host buffer until the reload is final, so no later version can mix into it.

KV of the old weights: ``finish_weight_update`` tells the tiersync KV connector, when the
engine runs one (``kv_both``), that the weights changed: its keys follow the new weights from
then on, and a load the scheduler planned before it learned of the change is refused (vLLM
recomputes those blocks), and so are the saves of a step planned before it (KV of the new
weights under the old weights' keys: on disk, an engine restarted on the old checkpoint would
load it). The scheduler hears of it with the next step's report and moves to new keys then. vLLM's own
prefix cache is the scheduler's: the trainer side resets it, and the connector's namespace,
after ``finish_weight_update`` (``reset_prefix_cache``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferUpdateInfo

from tiersync.errors import UsageError
from tiersync.integrations.vllm.engine_receiver import EngineReceiver, tell_kv_connector
from tiersync.integrations.vllm.weight_sync import WeightSyncConfig

__all__ = ["TierSyncUpdateInfo", "TierSyncWeightTransferEngine"]


@dataclass
class TierSyncUpdateInfo(WeightTransferUpdateInfo):
    """``{"version": v}``: make version ``v`` (or the later one that landed first) live."""

    version: int

    def __post_init__(self) -> None:
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 0:
            raise UsageError("must be an int >= 0", argument="update_info.version", value=self.version)


class TierSyncWeightTransferEngine(WeightTransferEngine[Any, TierSyncUpdateInfo]):
    """One per vLLM worker (see the module docstring)."""

    init_info_cls = WeightSyncConfig
    update_info_cls = TierSyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self._receiver: EngineReceiver | None = None
        self._config: WeightSyncConfig | None = None
        self._lease: Any = None
        self._reloading = False  # the model's layers are open for a layerwise reload
        self.applied: int | None = None

    def parse_init_info(self, init_dict: dict[str, Any]) -> WeightSyncConfig:
        return WeightSyncConfig.from_dict(init_dict)

    def init_transfer_engine(self, init_info: WeightSyncConfig) -> None:
        """Join the trainer: start this worker's receiver (:class:`EngineReceiver`)."""
        if self._receiver is not None:
            raise UsageError("joined already; call shutdown first", argument="init_info")
        world = int(self.parallel_config.world_size)
        self._receiver = EngineReceiver(init_info.receiver_config(int(self.parallel_config.rank) % world), world)
        self._config = init_info

    def start_weight_update(self) -> None:
        """The model is opened for the reload only once the version is here (receive_weights):
        a version that never lands leaves the model as it was (its weights were placeholders
        with no data, and vLLM, which ends the session on a failed update, refused the finish
        that would have put them back)."""
        if self._receiver is None:
            raise UsageError("call init_weight_transfer_engine first", argument="start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":  # the base class's device sync; nothing to wait for on a CPU
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: TierSyncUpdateInfo) -> None:
        """Wait for the version to land and lease it (a failure so far changes nothing), then
        open the model's layers for vLLM's layerwise reload and hand them the version's tensors
        (``load_weights``, HF names as in a checkpoint). The lease is held until finish. A load
        that fails is finalized at once (layers it did not reach get their old weights back),
        the KV connector told, the lease freed."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if self._receiver is None or self._config is None:
            raise UsageError("call init_weight_transfer_engine first", argument="update_weights")
        try:
            self._receiver.wait(update_info.version, self._config.apply_timeout_s)
            lease = self._receiver.receiver.acquire(self._config.apply_timeout_s)
            self._release()
            self._lease, self.applied = lease, None  # unknown until the reload is final
            if not self._reloading:
                initialize_layerwise_reload(self.model)
                self._reloading = True
            self.model.load_weights(self._receiver.named(lease.tensors))
        except BaseException:
            if self._reloading:  # a later chunk of a session failed too: vLLM will not finish it
                self._end_reload()
            raise

    def finish_weight_update(self) -> None:
        """Finalize the layerwise reload (none was opened: nothing changed), release the
        version's buffer, and move the tiersync KV connector (if any) to keys of the new weights
        (also when finalizing fails)."""
        if not self._reloading:
            self._release()
            return
        version = None if self._lease is None else self._lease.version
        self._end_reload()
        self.applied = version

    def _end_reload(self) -> None:
        """Finalize the open reload, free the lease, tell the KV connector the weights changed."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        try:
            if self._reloading:
                self._reloading = False
                finalize_layerwise_reload(self.model, self.model_config)
        finally:
            self._release()
            tell_kv_connector()

    def _release(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.release()

    def shutdown(self) -> None:
        """Leave the trainer and free the host buffers; the model keeps its weights."""
        self._release()
        receiver, self._receiver = self._receiver, None
        if receiver is not None:
            receiver.close()
