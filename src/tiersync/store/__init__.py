"""Layer 4: the KV cache store — stable prefix keys, a pinned index over host and storage."""

from tiersync.store.config import LookupResult, SaveResult, StoreConfig, StoreStats
from tiersync.store.futures import StoreFuture
from tiersync.store.keys import CacheIdentity, block_keys
from tiersync.store.kvstore import KVCacheStore
from tiersync.store.residency import OpStatus, Residency

__all__ = [
    "CacheIdentity",
    "KVCacheStore",
    "LookupResult",
    "OpStatus",
    "Residency",
    "SaveResult",
    "StoreConfig",
    "StoreFuture",
    "StoreStats",
    "block_keys",
]
