"""The host DRAM tier: a page-aligned arena of host blocks plus its allocator.

The arena mirrors the device block layout: host block ``b`` holds the live
bytes of device block(s) copied into it for every pool of a
:class:`~tiersync.layout.KVLayout` (block-major, see ``KVLayout.host_offsets``).
Memory is an anonymous ``mmap`` (page aligned, lazily faulted), a sealed memfd that
same-host readers may map (``shareable``: :mod:`tiersync.tiers.shareable`) or, for warm
boot, a segment in ``/dev/shm`` (:mod:`tiersync.tiers.shm`) that outlives the
process: blocks whose save was published are found again after a restart.

Contract of a save, for warm boot: ``allocate`` (the blocks' old manifest
entries are invalidated before they are handed out), write the bytes (d2h),
then ``publish(blocks, keys)``. A block whose publish returned is recovered
byte-exact by the next process; a block whose save was cut short is not served.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from tiersync.errors import CapacityError, ClosedError, UsageError, check_positive_int
from tiersync.telemetry.metrics import track_arena, untrack_arena
from tiersync.tiers.allocator import BlockAllocator
from tiersync.tiers.eviction import POLICIES, check_policy
from tiersync.tiers.prefault import Prefaulter
from tiersync.tiers.shareable import SharedRegion, open_shareable

if TYPE_CHECKING:
    from tiersync.layout.pool import KVLayout
    from tiersync.tiers.shm import RecoveredBlock, ShmConfig, ShmSegment

log = logging.getLogger("tiersync.host")


@dataclass(frozen=True, slots=True)
class HostArenaConfig:
    """``num_blocks`` host blocks of ``block_nbytes`` bytes; ``shm`` for warm boot. ``prefault``:
    populate anonymous memory in the background from the start (:mod:`tiersync.tiers.prefault`:
    first copies at memory speed, and the arena's full size resident soon after it is made).
    ``shareable``: anonymous memory in a sealed memfd that same-host readers map and copy
    from at memory speed (:attr:`HostArena.shared`); it forgoes transparent huge pages where
    the kernel keeps them from shared memory (``shmem_enabled``)."""

    num_blocks: int
    block_nbytes: int
    shm: ShmConfig | None = None
    policy: str = "lru"
    layout_digest: bytes = b"\0" * 16
    prefault: bool = True
    shareable: bool = False

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_nbytes"):
            check_positive_int(getattr(self, name), f"HostArenaConfig.{name}")
        check_policy(self.policy, "HostArenaConfig.policy")
        if not isinstance(self.layout_digest, bytes) or len(self.layout_digest) != 16:
            raise UsageError("must be 16 bytes", argument="HostArenaConfig.layout_digest")
        for flag in ("prefault", "shareable"):
            if not isinstance(getattr(self, flag), bool):
                raise UsageError("must be a bool", argument=f"HostArenaConfig.{flag}", value=getattr(self, flag))
        if self.shareable and self.shm is not None:
            raise UsageError("a warm-boot (shm) arena cannot also be shareable", argument="HostArenaConfig.shareable")

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_nbytes


class HostArena:
    """Host blocks and their allocator. Thread-safe through the allocator's lock."""

    def __init__(self, config: HostArenaConfig, *, on_evict: Callable[[list[int]], None] | None = None) -> None:
        if not isinstance(config, HostArenaConfig):
            raise UsageError("must be a HostArenaConfig", argument="config", got=type(config).__name__)
        self.config = config
        self._on_evict = on_evict
        self._segment: ShmSegment | None = None
        self._fd: int | None = None
        self._mmap: mmap.mmap | None = None
        self.shared: SharedRegion | None = None
        """Where same-host readers may map this arena (``shareable``), else None."""
        self.prefault: Prefaulter | None = None
        """Populates anonymous memory in the background (:mod:`tiersync.tiers.prefault`)."""
        self._keys: dict[int, bytes] = {}
        self.recovered: list[RecoveredBlock] = []
        buf = self._open_memory(config)
        try:
            self.memory = np.frombuffer(buf, dtype=np.uint8, count=config.nbytes).reshape(
                config.num_blocks, config.block_nbytes
            )
            self.address = self.memory.__array_interface__["data"][0]
            if self._fd is not None:
                self.shared = SharedRegion(self._fd, self.address, config.nbytes)
            self.allocator = BlockAllocator(config.num_blocks, policy=POLICIES[config.policy](), on_evict=self._evicted)
            if self.recovered:
                self.allocator.adopt_cached([r.block for r in self.recovered])
                self._keys = {r.block: r.key for r in self.recovered}
        except BaseException:
            self.memory = None  # type: ignore[assignment]
            self._release()
            raise
        self._closed = False
        track_arena(self)

    def allocated_bytes(self) -> int:
        """Bytes of blocks holding data (not free), 0 once closed (the metrics' gauge)."""
        if self._closed:
            return 0
        return (self.config.num_blocks - self.allocator.num_free) * self.config.block_nbytes

    @classmethod
    def for_layout(
        cls,
        layout: KVLayout,
        num_blocks: int,
        *,
        shm: ShmConfig | None = None,
        policy: str = "lru",
        on_evict: Callable[[list[int]], None] | None = None,
        prefault: bool = True,
    ) -> HostArena:
        """An arena whose blocks mirror ``layout`` (``layout.host_block_nbytes`` each)."""
        if not callable(getattr(layout, "digest", None)) or not isinstance(
            getattr(layout, "host_block_nbytes", None), int
        ):
            raise UsageError(
                "must be a KVLayout (tiersync.layout.kv_layout)", argument="layout", got=type(layout).__name__
            )
        cfg = HostArenaConfig(
            num_blocks=num_blocks,
            block_nbytes=layout.host_block_nbytes,
            shm=shm,
            policy=policy,
            layout_digest=layout.digest(),
            prefault=prefault,
        )
        return cls(cfg, on_evict=on_evict)

    def _open_memory(self, config: HostArenaConfig) -> mmap.mmap | memoryview:
        if config.shm is not None:
            return self._open_segment(config, config.shm)
        if config.shareable:
            self._fd, self._mmap = open_shareable(config.nbytes)
        else:
            try:
                self._mmap = mmap.mmap(-1, config.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            except (OSError, OverflowError) as exc:  # ENOMEM: more than this machine will map
                raise CapacityError(
                    "the host arena does not fit in memory",
                    argument="num_blocks",
                    requested=config.nbytes,
                    blocks=config.num_blocks,
                    error=str(exc),
                ) from None
        if hasattr(mmap, "MADV_HUGEPAGE"):  # fewer TLB misses on scattered block copies
            with contextlib.suppress(OSError):  # a kernel without THP for shared memory says EINVAL
                self._mmap.madvise(mmap.MADV_HUGEPAGE)
        if config.prefault:
            self.prefault = Prefaulter(self._mmap, config.nbytes)  # first copies at memory speed
        return self._mmap

    def _open_segment(self, config: HostArenaConfig, shm: ShmConfig) -> memoryview:
        from tiersync.tiers.shm import Geometry, ShmSegment

        geometry = Geometry(config.num_blocks, config.block_nbytes, config.layout_digest)
        self._segment = ShmSegment.open(shm, geometry)
        found = list(self._segment.recover())
        # an arena publishes whole blocks: an entry vouching for fewer bytes (another writer's)
        # would serve the rest unchecked, so it is left out and its block stays free
        self.recovered = [r for r in found if r.nbytes == config.block_nbytes]
        if len(self.recovered) < len(found):
            log.warning("warm boot from %s: %d partial blocks left out", shm.path, len(found) - len(self.recovered))
        if self._segment.cold_start is None:
            log.info("warm boot from %s: %d blocks recovered", shm.path, len(self.recovered))
        return self._segment.payload

    def __repr__(self) -> str:
        a = self.allocator
        where = self.config.shm.path if self.config.shm else "anonymous"
        return (
            f"<HostArena {where} blocks={a.num_blocks} x {self.config.block_nbytes} B "
            f"locked={a.num_locked} cached={a.num_cached} free={a.num_free}>"
        )

    # -- properties ----------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.config.num_blocks

    @property
    def block_nbytes(self) -> int:
        return self.config.block_nbytes

    @property
    def used_nbytes(self) -> int:
        return (self.num_blocks - self.allocator.num_free) * self.block_nbytes

    @property
    def persistent(self) -> bool:
        return self._segment is not None

    def block(self, b: int) -> memoryview:
        """Writable view of host block ``b`` (its full stride)."""
        self.check_open()
        if not isinstance(b, (int, np.integer)) or not 0 <= b < self.num_blocks:
            raise UsageError("block id out of range", argument="b", block=b, num_blocks=self.num_blocks)
        return memoryview(self.memory[int(b)])

    def key_of(self, b: int) -> bytes | None:
        """The key published for block ``b``, or None if none is published."""
        return self._keys.get(int(b))

    # -- lifecycle of blocks ------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` LOCKED blocks; their published entries are withdrawn first. See BlockAllocator.allocate."""
        self.check_open()
        blocks = self.allocator.allocate(n)
        self._withdraw(blocks)
        return blocks

    def publish(self, blocks: Sequence[int], keys: Sequence[bytes]) -> None:
        """Record that ``blocks`` now hold the data of ``keys`` (after their save completed).

        With shm backing each entry is checksummed and marked valid last, so a
        restart recovers it. Blocks must be LOCKED by the caller.
        """
        self.check_open()
        blocks = [int(b) for b in blocks]
        if len(blocks) != len(keys):
            raise UsageError("needs one key per block", argument="keys", blocks=len(blocks), keys=len(keys))
        for k in keys:
            if not isinstance(k, bytes) or not 0 < len(k) <= 32:
                raise UsageError("keys must be 1..32 bytes", argument="keys", key=k)
        if not self.allocator.all_locked(blocks):
            raise UsageError("blocks must be locked while publishing", argument="blocks")
        for b, k in zip(blocks, keys):
            if self._segment is not None:
                self._segment.publish(b, k)
            self._keys[b] = k

    def _withdraw(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self._keys.pop(b, None)
        if self._segment is not None:
            self._segment.invalidate(blocks)

    def _evicted(self, blocks: list[int]) -> None:
        if self._on_evict is not None:
            self._on_evict(blocks)

    def free(self, blocks: Sequence[int]) -> None:
        """Forget and free blocks (CACHED, or LOCKED once by the caller)."""
        self.check_open()
        self.allocator.free(blocks)
        self._withdraw(blocks)

    def close(self) -> None:
        """Release the memory. Idempotent. Shm segments stay on disk for the next process."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        untrack_arena(self)
        self.memory = None  # type: ignore[assignment]
        self._release()

    def _release(self) -> None:
        """Detach the segment, stop the prefaulter, unmap, close the memfd (readers' maps of
        it outlive the descriptor; ``shared`` names nothing any more)."""
        if self._segment is not None:
            try:
                self._segment.close()
            except UsageError:  # views of the memory are still alive somewhere
                log.warning(
                    "host arena closed while views of %s are alive: the segment stays "
                    "attached (and locked) until they are released",
                    self._segment.config.path,
                )
        if self.prefault is not None:
            self.prefault.stop()
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:  # a view is still exported; the map is freed with it
                pass
        self.shared = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def check_open(self) -> None:
        """ClosedError once the arena is closed."""
        if getattr(self, "_closed", False):
            raise ClosedError("host arena is closed")

    def __enter__(self) -> HostArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
