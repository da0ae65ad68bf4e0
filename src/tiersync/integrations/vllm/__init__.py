"""vLLM integration: ``TierSyncConnector`` (import path ``tiersync.integrations.vllm``).

Importing this package imports vLLM; ``import tiersync`` never does.
"""
from tiersync.integrations.vllm.connector import TierSyncConnector

__all__ = ["TierSyncConnector"]
