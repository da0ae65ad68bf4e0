"""Pages by 16-byte key in tiersync's host and disk tiers, with every byte read back verified.

No SGLang and no torch here: a page is a byte buffer. :class:`PageTiers` keeps

- a host tier: a :class:`~tiersync.tiers.host.HostArena` made on the first page (its blocks are
  that page's size), used as a cache: a block holding a page is CACHED in the arena's allocator,
  so allocating evicts the coldest (the arena's policy) and ``on_evict`` forgets it here. The
  arena keeps no checksum of anonymous memory, so this class keeps an xxh3_64 per block and
  checks every copy out of it; a page that fails is dropped and read from disk instead.
- a disk tier: a :class:`~tiersync.tiers.storage.StorageTier` (durable segments, an xxh3_64
  per block, checked on every read; a block that fails is reported CORRUPT, deleted there and
  never served), at most ``disk_bytes`` of pages, the least recently used deleted first
  (:class:`~tiersync.integrations.sglang.disk_budget.DiskBudget`).

Writes go through: a page is acknowledged once the disk tier has it (durable with ``fsync``),
and is then also cached on host. Reads try host, then disk, and land what disk served on host.
Thread-safe: one lock guards the host tier (copies in and out of it run under it, so a block is
never evicted or freed mid-copy); the disk tier is thread-safe itself.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import numpy as np
import xxhash

from tiersync.errors import CapacityError, ClosedError, UsageError
from tiersync.integrations.sglang.config import HiCacheConfig
from tiersync.integrations.sglang.disk_budget import DiskBudget
from tiersync.tiers.host import HostArena, HostArenaConfig
from tiersync.tiers.storage import ReadStatus, StorageConfig, StorageTier

__all__ = ["PageTiers"]

log = logging.getLogger("tiersync.sglang")
_checksum = xxhash.xxh3_64_intdigest


class PageTiers:
    """Pages of one cache ``identity`` (16 bytes: the disk tier's identity) in the tiers ``config`` names."""

    def __init__(self, config: HiCacheConfig, identity: bytes) -> None:
        if not isinstance(config, HiCacheConfig):
            raise UsageError("must be a HiCacheConfig", argument="config", got=type(config).__name__)
        self.config = config
        self.storage: StorageTier | None = None
        self._budget: DiskBudget | None = None
        if config.storage_dir is not None:
            self.storage = StorageTier(
                StorageConfig(directory=config.storage_dir, identity=identity, fsync=config.fsync)
            )
            self._budget = DiskBudget(self.storage, config.disk_bytes)
        self.arena: HostArena | None = None
        self._host_off = config.host_bytes == 0
        self._blocks: dict[bytes, int] = {}  # key -> host block
        self._sums: dict[int, int] = {}  # host block -> xxh3_64 of the page it holds
        self._lock = threading.Lock()
        self._generation = 0  # bumped by clear(): what a put or get began before it is not kept
        self._closed = False

    # -- queries -------------------------------------------------------------
    def prefix(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are all present (a gap stops the count).

        On a miss the disk tier's directory is scanned once for segments written since the
        last scan (by another process, or before a restart), then the count is taken again.
        """
        n = self._count(keys)
        if n < len(keys) and self.storage is not None:
            self.storage.refresh()
            n += self._count(keys[n:])
        return n

    def _count(self, keys: Sequence[bytes]) -> int:
        for i, k in enumerate(keys):
            with self._lock:
                here = k in self._blocks
            if not here and not (self.storage is not None and self.storage.contains(k)):
                return i
        return len(keys)

    # -- writes --------------------------------------------------------------
    def put(self, keys: Sequence[bytes], pages: Sequence[memoryview]) -> list[bool]:
        """Store ``pages[i]`` as ``keys[i]``; one flag per key: True once it is kept (on disk
        when there is a disk tier, else on host). A key already on disk is not written again."""
        self._check_open()
        keys, pages = list(keys), [memoryview(p).cast("B") for p in pages]
        if len(keys) != len(pages):
            raise UsageError("needs one page per key", argument="pages", keys=len(keys), pages=len(pages))
        generation = self._now()
        if self.storage is None:
            return self._cache(keys, pages, generation)
        ok = self._write(keys, pages)
        if self._now() != generation:  # cleared while writing: these pages predate the clear
            self.storage.delete(keys)
            return [False] * len(keys)
        self._cache([k for k, good in zip(keys, ok) if good], [p for p, good in zip(pages, ok) if good], generation)
        return ok

    def _now(self) -> int:
        with self._lock:
            return self._generation

    def _write(self, keys: list[bytes], pages: list[memoryview]) -> list[bool]:
        assert self.storage is not None and self._budget is not None  # put() writes only with a disk tier
        new = [i for i, k in enumerate(keys) if not self.storage.contains(k)]
        fit = self._budget.room(len(pages[new[0]]), [keys[i] for i in new]) if new else 0
        failed = set(new[fit:])  # more than the whole disk budget: the first pages are kept
        if fit:
            try:
                self.storage.write([keys[i] for i in new[:fit]], [pages[i] for i in new[:fit]]).result()
            except (CapacityError, UsageError, OSError) as exc:  # disk full, read-only directory
                log.warning("tiersync: %d page(s) not written to %s: %s", fit, self.storage.directory, exc)
                failed |= set(new[:fit])
        self._budget.used([k for i, k in enumerate(keys) if i not in failed])
        return [i not in failed for i in range(len(keys))]

    def _cache(self, keys: list[bytes], pages: list[memoryview], generation: int) -> list[bool]:
        """Copy pages into host blocks (evicting the coldest) unless a clear came after
        ``generation``; one flag per key: is it on host now."""
        with self._lock:
            if self._generation != generation:
                return [False] * len(keys)
            if self._closed or not keys or not self._ensure_arena(len(pages[0])):
                return [k in self._blocks for k in keys]
            arena = self.arena
            todo = list(
                {k: p for k, p in zip(keys, pages) if k not in self._blocks and len(p) == arena.block_nbytes}.items()
            )
            todo = todo[-arena.num_blocks :]  # a batch larger than the tier keeps its last pages
            try:
                blocks = arena.allocate(len(todo)) if todo else []
            except CapacityError:
                blocks, todo = [], []
            for b, (k, page) in zip(blocks, todo):
                arena.memory[b][:] = np.frombuffer(page, dtype=np.uint8)
                self._sums[b] = _checksum(page)
                self._blocks[k] = b
            if blocks:
                arena.publish(blocks, [k for k, _ in todo])
                arena.allocator.unlock(blocks)  # CACHED: evictable, coldest first
            return [k in self._blocks for k in keys]

    def _ensure_arena(self, page_nbytes: int) -> bool:
        if self.arena is None and not self._host_off:
            num_blocks = self.config.host_bytes // page_nbytes if page_nbytes else 0
            if num_blocks == 0:
                log.warning(
                    "tiersync: host_bytes=%d holds no page of %d bytes: no host tier",
                    self.config.host_bytes,
                    page_nbytes,
                )
                self._host_off = True
                return False
            self.arena = HostArena(
                HostArenaConfig(num_blocks=num_blocks, block_nbytes=page_nbytes, policy=self.config.eviction),
                on_evict=self._evicted,
            )
        return self.arena is not None

    def _evicted(self, blocks: list[int]) -> None:
        """The arena's allocator evicted ``blocks`` (called inside ``allocate``, under ``_lock``)."""
        for b in blocks:
            key = self.arena.key_of(b)
            if key is not None and self._blocks.get(key) == b:
                del self._blocks[key]
            self._sums.pop(b, None)

    # -- reads ---------------------------------------------------------------
    def get(self, keys: Sequence[bytes], views: Sequence[memoryview]) -> list[bool]:
        """Read ``keys[i]`` into ``views[i]`` (exactly the page's size); one flag per key.

        True: the view holds the page's bytes, verified. False (missing, the wrong size,
        failed its checksum, unreadable): the view's bytes are unspecified and must not be used.
        """
        self._check_open()
        keys, views = list(keys), [memoryview(v).cast("B") for v in views]
        if len(keys) != len(views):
            raise UsageError("needs one view per key", argument="views", keys=len(keys), views=len(views))
        generation = self._now()
        ok = [self._from_host(k, v) for k, v in zip(keys, views)]
        cold = [i for i, good in enumerate(ok) if not good]
        if cold and self.storage is not None:
            got = self._from_disk([keys[i] for i in cold], [views[i] for i in cold])
            for i, good in zip(cold, got):
                ok[i] = good
            hits = [i for i, good in zip(cold, got) if good]
            self._cache([keys[i] for i in hits], [views[i] for i in hits], generation)
        return ok

    def _from_host(self, key: bytes, view: memoryview) -> bool:
        with self._lock:
            b = self._blocks.get(key)
            if b is None or self._closed or len(view) != self.arena.block_nbytes:
                return False
            np.frombuffer(view, dtype=np.uint8)[:] = self.arena.memory[b]
            if _checksum(view) == self._sums[b]:
                self.arena.allocator.touch([b])
                return True
            del self._blocks[key]
            self._sums.pop(b, None)
            self.arena.free([b])
        log.error("tiersync: host copy of page %s failed its checksum: dropped, not served", key.hex())
        return False

    def _from_disk(self, keys: list[bytes], views: list[memoryview]) -> list[bool]:
        try:
            statuses = self.storage.read(keys, views).result()
        except UsageError:  # a view not the size of its stored page: read the others one by one
            if len(keys) == 1:
                return [False]
            return [self._from_disk([k], [v])[0] for k, v in zip(keys, views)]
        except OSError as exc:
            log.warning("tiersync: reading %d page(s) from %s failed: %s", len(keys), self.storage.directory, exc)
            return [False] * len(keys)
        for k, s in zip(keys, statuses):
            if s is ReadStatus.CORRUPT:
                log.error("tiersync: disk copy of page %s failed its checksum: deleted, not served", k.hex())
        if self._budget is not None:
            self._budget.used([k for k, s in zip(keys, statuses) if s is ReadStatus.OK])
        return [s is ReadStatus.OK for s in statuses]

    # -- lifecycle -----------------------------------------------------------
    def clear(self) -> None:
        """Forget every page of this identity, on host and on disk (for good: a restart does not
        bring them back). Pages of other identities in the same directory stay. A put or get
        that began before it keeps nothing: its pages are deleted once written, not cached."""
        with self._lock:
            self._generation += 1
            if self.arena is not None and self._blocks:
                self.arena.free(list(self._blocks.values()))
            self._blocks.clear()
            self._sums.clear()
        if self.storage is not None:
            self.storage.refresh()
            self.storage.delete(self.storage.keys())
            with self._lock:  # what began while the disk was cleared keeps nothing either
                self._generation += 1

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the tiersync HiCache backend is closed")

    def close(self) -> None:
        """Finish disk I/O and release host memory. Idempotent; the disk tier's files stay."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.arena is not None:
                self.arena.close()
        if self.storage is not None:
            self.storage.close()
