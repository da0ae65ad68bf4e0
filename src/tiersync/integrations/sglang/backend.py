"""``TierSyncHiCacheStorage``: SGLang's HiCache storage (L3) backend on tiersync's tiers.

SGLang loads it with ``--hicache-storage-backend dynamic`` and
``--hicache-storage-backend-extra-config '{"backend_name": "tiersync", "module_path":
"tiersync.integrations.sglang", "class_name": "TierSyncHiCacheStorage", ...}'``; its factory
calls ``TierSyncHiCacheStorage(storage_config, kwargs)`` and then ``register_mem_pool_host``
with the host KV pool (L2). Settings: :mod:`tiersync.integrations.sglang.config`.

SGLang names a page by a string (a chained SHA-256 of its tokens, hex); here that string is
hashed with xxh3_128, salted by :func:`~tiersync.integrations.sglang.config.namespace` (model,
weights, shard) and the host pool's page format (layout, dtype, page size), into tiersync's
16-byte key. A page's bytes are the host pool's flat page (``get_data_page(i, flat=True)``),
written back with ``set_from_flat_data_page``, exactly as SGLang's own file backend does.

Both of SGLang's call paths work: ``batch_set`` / ``batch_get`` with page tensors (the default
for a dynamic backend) and, with ``"interface_v1": 1``, ``batch_set_v1`` / ``batch_get_v1``
with host-pool indices (``host_indices``: one per token, ``page_size`` per page; page ``i``
starts at ``host_indices[i * page_size]``). Not implemented: the v2 multi-pool calls
(``batch_*_v2``: hybrid models' Mamba / SWA / indexer sidecar pools) — SGLang's base class
raises NotImplementedError for them.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import xxhash
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from tiersync.errors import UsageError
from tiersync.integrations.sglang.config import HiCacheConfig, namespace
from tiersync.integrations.sglang.pages import PageTiers

__all__ = ["TierSyncHiCacheStorage"]

log = logging.getLogger("tiersync.sglang")


class TierSyncHiCacheStorage(HiCacheStorage):
    """HiCache pages in tiersync's host and disk tiers; every byte read back is verified, so a
    missing, damaged or foreign page reads as a miss (False / None), never as wrong bytes."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        if not isinstance(storage_config, HiCacheStorageConfig):
            raise UsageError(
                "must be SGLang's HiCacheStorageConfig", argument="storage_config", got=type(storage_config).__name__
            )
        self.storage_config = storage_config
        self.config = HiCacheConfig.from_extra(storage_config.extra_config)
        self.identity = namespace(storage_config, self.config.weights_version)
        self.tiers = PageTiers(self.config, self.identity)
        self.mem_pool_host: Any = None
        self._salt = self.identity

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang's host KV pool (L2): its page format joins the key salt, so pages written in
        another layout or dtype are never read into this one."""
        super().register_mem_pool_host(mem_pool_host)
        fmt = (
            f"{getattr(mem_pool_host, 'layout', '')}|{getattr(mem_pool_host, 'dtype', '')}"
            f"|{getattr(mem_pool_host, 'page_size', '')}"
        )
        self._salt = self.identity + xxhash.xxh3_128_digest(fmt.encode())

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A hybrid model's extra host pool (Mamba states, sliding-window or indexer KV): refused,
        so SGLang's attach fails loudly. SGLang's base accepted it, then its prefetch thread
        called ``batch_exists_v2``, which raises NotImplementedError, and ended for good."""
        raise UsageError(
            "the tiersync HiCache backend stores the KV pool only, not a hybrid model's extra host pools",
            argument="host_pool_name",
            value=str(host_pool_name),
        )

    def _keys(self, keys: list[str]) -> list[bytes]:
        return [xxhash.xxh3_128_digest(self._salt + k.encode()) for k in keys]

    # -- existence -----------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self.tiers.prefix(self._keys([key])) == 1

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many of ``keys``, from the first, are all stored (a gap stops the count)."""
        return self.tiers.prefix(self._keys(keys))

    # -- page tensors (SGLang's default path for a dynamic backend) ----------
    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        if values is None or len(values) != len(keys):
            log.error("tiersync: batch_set needs one page tensor per key")
            return False
        return all(self.tiers.put(self._keys(keys), [_page_bytes(v) for v in values]))

    def set(
        self, key: str, value: Any | None = None, target_location: Any | None = None, target_sizes: Any | None = None
    ) -> bool:
        return self.batch_set([key], None if value is None else [value])

    def batch_get(
        self, keys: list[str], target_locations: Any | None = None, target_sizes: Any | None = None
    ) -> list[torch.Tensor | None]:
        """Fill ``target_locations[i]`` (flat page tensors; default: fresh dummy pages of the
        registered pool) with page ``keys[i]``; the tensor, or None where the page is not served."""
        targets = list(target_locations) if target_locations is not None else [self._dummy_page() for _ in keys]
        if len(targets) != len(keys) or any(t is None for t in targets):
            log.error("tiersync: batch_get needs one target tensor per key (or a registered host pool)")
            return [None] * len(keys)
        ok = self.tiers.get(self._keys(keys), [_page_bytes(t, writable=True) for t in targets])
        return [t if good else None for t, good in zip(targets, ok)]

    def get(self, key: str, target_location: Any | None = None, target_sizes: Any | None = None) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def _dummy_page(self) -> torch.Tensor | None:
        return None if self.mem_pool_host is None else self.mem_pool_host.get_dummy_flat_data_page()

    # -- host-pool indices ("interface_v1": 1) -------------------------------
    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        slots = self._slots(keys, host_indices)
        if slots is None:
            return [False] * len(keys)
        pages = [_page_bytes(self.mem_pool_host.get_data_page(s, flat=True)) for s in slots]
        return self.tiers.put(self._keys(keys), pages)

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        slots = self._slots(keys, host_indices)
        if slots is None:
            return [False] * len(keys)
        pool = self.mem_pool_host
        pages = [pool.get_dummy_flat_data_page() for _ in slots]
        ok = self.tiers.get(self._keys(keys), [_page_bytes(p, writable=True) for p in pages])
        for slot, page, good in zip(slots, pages, ok):
            if good:
                pool.set_from_flat_data_page(slot, page)
        return ok

    def _slots(self, keys: list[str], host_indices: torch.Tensor) -> list[int] | None:
        """The host-pool index where each key's page starts, or None (logged) if they do not fit."""
        pool = self.mem_pool_host
        if pool is None:
            log.error("tiersync: no host pool registered (register_mem_pool_host) for a v1 call")
            return None
        page_size = int(getattr(pool, "page_size", 1) or 1)
        if host_indices is None or host_indices.numel() != len(keys) * page_size:
            log.error(
                "tiersync: %d key(s) need %d host indices, got %s",
                len(keys),
                len(keys) * page_size,
                None if host_indices is None else host_indices.numel(),
            )
            return None
        return [int(host_indices[i * page_size]) for i in range(len(keys))]

    # -- lifecycle -----------------------------------------------------------
    def clear(self) -> bool:
        """Forget every page of this namespace (host and disk, for good). True when done."""
        self.tiers.clear()
        log.info("tiersync: cleared the HiCache pages of this namespace")
        return True

    def close(self) -> None:
        self.tiers.close()

    def get_stats(self):
        return None


def _page_bytes(page: torch.Tensor, writable: bool = False) -> memoryview:
    """The bytes of a flat page tensor (a CPU tensor of any dtype). ``writable``: a view of the
    tensor's own memory, for reading a page into it (so it must be contiguous)."""
    flat = page.reshape(-1)  # a copy when the page is not contiguous (get_data_page of layer_first)
    if writable and flat.data_ptr() != page.data_ptr():
        raise UsageError("a page tensor to read into must be contiguous", argument="target_location")
    return memoryview(flat.view(torch.uint8).numpy())
