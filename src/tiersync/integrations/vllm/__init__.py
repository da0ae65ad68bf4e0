"""vLLM integration (import path ``tiersync.integrations.vllm``).

- ``TierSyncConnector``: the KV connector (``kv_connector_module_path="tiersync.integrations.vllm"``).
- :mod:`~tiersync.integrations.vllm.weight_sync`: ``WeightSyncExtension`` (a
  ``worker_extension_cls``) and ``join_weight_sync`` / ``update_weights``, live weight updates
  from a trainer's :class:`~tiersync.weights.WeightPublisher`.

Importing this package imports nothing from vLLM; ``TierSyncConnector`` is imported (with
vLLM) on first access, and ``import tiersync`` never does.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TierSyncConnector"]


def __getattr__(name: str) -> Any:
    if name == "TierSyncConnector":
        from tiersync.integrations.vllm.connector import TierSyncConnector

        return TierSyncConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
