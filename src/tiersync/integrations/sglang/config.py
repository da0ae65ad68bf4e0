"""The backend's settings, from SGLang's ``--hicache-storage-backend-extra-config`` (a JSON object),
and the namespace that keeps the pages of different models, weights and shards apart.

===================  =========================================================================
key                  meaning (default)
===================  =========================================================================
``host_bytes``       host DRAM that caches pages in front of the disk tier, int or "4GiB";
                     0: no host tier ("1GiB")
``storage_dir``      directory of the disk tier (checksummed segments, durable, shared by
                     every rank and by later runs); None: host tier only (None)
``disk_bytes``       most bytes of live pages this namespace keeps in ``storage_dir``, int
                     or "100GiB"; the least recently used go first; a segment file goes
                     once none of its pages lives (up to 16 MiB of pages a write batch),
                     so the files can exceed it by what partly live segments hold;
                     None: until the disk is full (None)
``eviction``         host tier eviction policy, "lru" or "s3fifo" ("lru")
``weights_version``  bump it on a weight update so old KV is never reused ("0"); an update
                     in place (SGLang's ``update_weights_from_*``) does not reach this
                     backend (SGLang's flush after it leaves L3 alone): follow it with
                     SGLang's ``/clear_hicache_storage_backend``, which calls ``clear()``
``fsync``            a write is acknowledged only once it is on disk (true)
===================  =========================================================================

SGLang's own keys of the same object are accepted and left to SGLang: ``backend_name``,
``module_path``, ``class_name`` (the dynamic loader) and ``interface_v1`` (1: SGLang calls
``batch_get_v1`` / ``batch_set_v1`` with host-pool indices instead of ``batch_get`` /
``batch_set`` with page tensors; both work). Any other key is refused by name: a typo must not
silently drop the disk tier.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import xxhash

from tiersync.errors import UsageError
from tiersync.sizes import parse_size
from tiersync.store.keys import CacheIdentity
from tiersync.tiers.eviction import check_policy

__all__ = ["HiCacheConfig", "namespace"]

EXTRA = "hicache_storage_backend_extra_config"
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
KEYS = frozenset({"host_bytes", "storage_dir", "disk_bytes", "eviction", "weights_version", "fsync"})
_BOOLS = {"true": True, "1": True, "false": False, "0": False}


@dataclass(frozen=True, slots=True)
class HiCacheConfig:
    """Validated settings of :class:`~tiersync.integrations.sglang.TierSyncHiCacheStorage`
    (see the module docstring for each key). At least one tier: ``host_bytes`` > 0 or a
    ``storage_dir``."""

    host_bytes: int = 1 << 30
    storage_dir: str | None = None
    disk_bytes: int | None = None
    eviction: str = "lru"
    weights_version: str = "0"
    fsync: bool = True

    def __post_init__(self) -> None:
        hb = self.host_bytes
        if not isinstance(hb, int) or isinstance(hb, bool) or hb < 0:
            raise UsageError(
                "must be a size such as 4GiB, a number of bytes, or 0", argument=f"{EXTRA}.host_bytes", value=hb
            )
        if self.storage_dir is not None and (not isinstance(self.storage_dir, str) or not self.storage_dir):
            raise UsageError(
                "must be a directory path or None", argument=f"{EXTRA}.storage_dir", value=self.storage_dir
            )
        db = self.disk_bytes
        if db is not None and (not isinstance(db, int) or isinstance(db, bool) or db <= 0):
            raise UsageError(
                "must be a size such as 100GiB, a number of bytes > 0, or null",
                argument=f"{EXTRA}.disk_bytes",
                value=db,
            )
        if hb == 0 and self.storage_dir is None:
            raise UsageError(
                "no tier to store pages in: give a storage_dir or host_bytes > 0", argument=f"{EXTRA}.storage_dir"
            )
        check_policy(self.eviction, f"{EXTRA}.eviction")
        if not isinstance(self.weights_version, str) or not self.weights_version:
            raise UsageError("must be a non-empty str", argument=f"{EXTRA}.weights_version", value=self.weights_version)
        if not isinstance(self.fsync, bool):
            raise UsageError("must be true or false", argument=f"{EXTRA}.fsync", value=self.fsync)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> HiCacheConfig:
        """Parse SGLang's ``storage_config.extra_config``; unknown keys are refused by name."""
        if extra is not None and not isinstance(extra, Mapping):
            raise UsageError("must be a JSON object", argument=EXTRA, got=type(extra).__name__)
        extra = dict(extra or {})
        unknown = sorted(set(extra) - KEYS - SGLANG_KEYS)
        if unknown:
            raise UsageError(
                f"unknown key {unknown[0]!r}", argument=f"{EXTRA}.{unknown[0]}", unknown=unknown, known=sorted(KEYS)
            )
        values = {k: v for k, v in extra.items() if k in KEYS}
        for key in ("host_bytes", "disk_bytes"):
            if isinstance(values.get(key), str):
                values[key] = _size(values[key], key)
        if isinstance(values.get("fsync"), str):
            values["fsync"] = _BOOLS.get(values["fsync"].strip().lower(), values["fsync"])
        return cls(**values)


def _size(text: str, key: str) -> int:
    if text.strip() == "0":
        return 0
    try:
        return parse_size(text)
    except UsageError:
        raise UsageError(
            "must be a size such as 4GiB, a number of bytes, or 0", argument=f"{EXTRA}.{key}", value=text
        ) from None


def namespace(storage_config: Any, weights_version: str) -> bytes:
    """16-byte digest of what makes two pages of the same key interchangeable: the model (SGLang
    tags its name with the host pool's page format, if it has one), the weights, and the shard
    (pipeline stage, context-parallel and decode-context-parallel rank, and the tensor-parallel
    rank unless the KV is replicated across them, as MLA's is). It is the disk tier's cache
    identity (segments of another identity are never read) and salts every key."""
    sc = storage_config
    replicated = bool(sc.is_mla_model)
    shard = (
        f"pp{sc.pp_rank}/{sc.pp_size}|cp{sc.attn_cp_rank}/{sc.attn_cp_size}"
        f"|dcp{getattr(sc, 'dcp_rank', 0)}/{getattr(sc, 'dcp_size', 1)}"
        f"|tp{'*' if replicated else sc.tp_size}|page_first={bool(sc.is_page_first_layout)}"
    )
    identity = CacheIdentity(
        model=sc.model_name or "-",
        weights_version=weights_version,
        kv_dtype="auto",
        block_size=1,
        layout_digest=xxhash.xxh3_128_digest(shard.encode()),
        rank=0 if replicated else int(sc.tp_rank),
    )
    return identity.digest()
