"""Configuration and result types of the KV cache store."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tiersync.errors import UsageError, check_positive_int
from tiersync.store.residency import Residency
from tiersync.tiers.eviction import check_policy

if TYPE_CHECKING:
    from tiersync.tiers.shm import ShmConfig
    from tiersync.transfer.engine import TransferConfig


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """``host_blocks`` host blocks (``shm`` for warm boot); ``policy`` orders eviction in
    every tier. With a storage tier, when free host blocks fall under ``low_watermark``
    (fraction of ``host_blocks``) the coldest unpinned host entries are demoted to
    storage, ``demote_batch`` per segment, until ``high_watermark`` are free. A save or
    promotion waits at most ``demote_wait_s`` for the storage write of the entries it would
    evict (:mod:`tiersync.store.demotion`)."""

    host_blocks: int
    policy: str = "lru"
    shm: ShmConfig | None = None
    low_watermark: float = 0.03
    high_watermark: float = 0.05
    demote_batch: int = 128
    transfer: TransferConfig | None = None
    demote_wait_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("host_blocks", "demote_batch"):
            check_positive_int(getattr(self, name), f"StoreConfig.{name}")
        check_policy(self.policy, "StoreConfig.policy")
        w = self.demote_wait_s
        if not isinstance(w, (int, float)) or isinstance(w, bool) or not 0 < w < float("inf"):
            raise UsageError("must be a positive number of seconds", argument="StoreConfig.demote_wait_s", value=w)
        if not 0.0 <= self.low_watermark <= self.high_watermark <= 1.0:
            raise UsageError(
                "needs 0 <= low_watermark <= high_watermark <= 1",
                argument="StoreConfig.low_watermark",
                low=self.low_watermark,
                high=self.high_watermark,
            )


@dataclass(frozen=True, slots=True)
class LookupResult:
    """The hit prefix of a lookup: ``keys[i]`` is pinned once and has copies in ``residency[i]``."""

    keys: tuple[bytes, ...]
    residency: tuple[Residency, ...]
    requested: int

    @property
    def num_hits(self) -> int:
        return len(self.keys)

    @property
    def complete(self) -> bool:
        return len(self.keys) == self.requested

    def __len__(self) -> int:
        return len(self.keys)


@dataclass(frozen=True, slots=True)
class SaveResult:
    """``saved`` keys are now host-resident; ``skipped`` were already present (or being saved)."""

    saved: tuple[bytes, ...]
    skipped: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class StoreStats:
    entries: int
    host_entries: int
    storage_entries: int
    host_free_blocks: int
    host_evictable: int
    storage_evictable: int
    pinned: int
