"""SGLang integration (import path ``tiersync.integrations.sglang``).

- ``TierSyncHiCacheStorage``: a HiCache storage (L3) backend on tiersync's host and disk tiers
  (:mod:`~tiersync.integrations.sglang.backend`), loaded by SGLang with
  ``--hicache-storage-backend dynamic --hicache-storage-backend-extra-config
  '{"backend_name": "tiersync", "module_path": "tiersync.integrations.sglang",
  "class_name": "TierSyncHiCacheStorage", "storage_dir": "/mnt/nvme/kv"}'``.
- :class:`~tiersync.integrations.sglang.config.HiCacheConfig`: its settings (the other keys of
  that JSON object).

Importing this package imports nothing from SGLang; ``TierSyncHiCacheStorage`` is imported (with
SGLang and torch) on first access, and ``import tiersync`` never does.
"""

from __future__ import annotations

from typing import Any

from tiersync.integrations.sglang.config import HiCacheConfig

__all__ = ["HiCacheConfig", "TierSyncHiCacheStorage"]


def __getattr__(name: str) -> Any:
    if name == "TierSyncHiCacheStorage":
        from tiersync.integrations.sglang.backend import TierSyncHiCacheStorage

        return TierSyncHiCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
