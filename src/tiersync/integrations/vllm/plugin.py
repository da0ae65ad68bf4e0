"""vLLM plugin entry point (``vllm.general_plugins``): registers tiersync's weight-transfer backend.

vLLM calls :func:`register` in every process it starts (API server, engine core, workers), so
``--weight-transfer-config '{"backend": "tiersync"}'`` finds the backend without user code.
Registration is lazy (module paths, imported when the backend is selected) and idempotent.
"""

from __future__ import annotations

__all__ = ["BACKEND", "register"]

BACKEND = "tiersync"
_MODULE = "tiersync.integrations.vllm"


def register() -> None:
    """Register ``"tiersync"`` with vLLM's worker-side and trainer-side weight-transfer factories."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for factory, module, cls in (
        (WeightTransferEngineFactory, f"{_MODULE}.weight_transfer", "TierSyncWeightTransferEngine"),
        (WeightTransferTrainerFactory, f"{_MODULE}.weight_trainer", "TierSyncTrainerWeightTransferEngine"),
    ):
        try:
            factory.register_engine(BACKEND, module, cls)
        except ValueError:  # registered already (vLLM refuses a second registration)
            pass
