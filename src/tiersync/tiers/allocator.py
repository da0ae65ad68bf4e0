"""Host block allocator: free, locked and evictable (cached) blocks.

Every block is in exactly one state:

- FREE — holds nothing;
- LOCKED — holds data someone is using; ``lock_count`` >= 1; never evicted;
- CACHED — holds data nobody has locked; evictable by the policy.

``allocate`` takes free blocks first, then evicts cached ones (the policy
chooses), and hands back LOCKED blocks. It is all-or-nothing: on
:class:`CapacityError` no block changed state. Evicted blocks are reported to
``on_evict`` (called with the allocator's lock held: keep it short, do not call
back into the allocator) so an index above can forget them.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import numpy.typing as npt

from tiersync.errors import CapacityError, UsageError, check_positive_int
from tiersync.tiers.eviction import EvictionPolicy, LRUPolicy


class BlockState(enum.IntEnum):
    FREE = 0
    LOCKED = 1
    CACHED = 2


class BlockAllocator:
    """Thread-safe allocator over ``num_blocks`` host block ids ``0..num_blocks-1``."""

    def __init__(
        self,
        num_blocks: int,
        *,
        policy: EvictionPolicy[int] | None = None,
        on_evict: Callable[[list[int]], None] | None = None,
    ) -> None:
        check_positive_int(num_blocks, "num_blocks")
        self.num_blocks = num_blocks
        self._policy: EvictionPolicy[int] = policy if policy is not None else LRUPolicy()
        self._on_evict = on_evict
        self._locks = np.zeros(num_blocks, dtype=np.int64)
        self._state = np.zeros(num_blocks, dtype=np.int8)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() yields ascending ids
        self._mutex = threading.RLock()

    # -- queries -------------------------------------------------------------
    def state(self, block: int) -> BlockState:
        return BlockState(int(self._state[self._check_id(block, "block")]))

    def lock_count(self, block: int) -> int:
        return int(self._locks[self._check_id(block, "block")])

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._policy)

    @property
    def num_locked(self) -> int:
        return self.num_blocks - self.num_free - self.num_cached

    def all_locked(self, blocks: Iterable[int]) -> bool:
        ids = self._ids(blocks, "blocks")
        return bool((self._state[ids] == BlockState.LOCKED).all()) if ids.size else True

    # -- transitions ---------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Return ``n`` LOCKED blocks (free first, then evicted). Raises CapacityError, changing nothing."""
        check_positive_int(n, "n")
        with self._mutex:
            need = n - len(self._free)
            victims: list[int] = []
            if need > 0:
                chosen = self._policy.choose(need)
                if chosen is None:
                    raise CapacityError(
                        "host arena full: not enough free or evictable blocks",
                        requested=n,
                        used=self.num_locked,
                        free=self.num_free + self.num_cached,
                    )
                victims = [int(b) for b in chosen]
                for b in victims:
                    self._policy.remove(b)
                if self._on_evict is not None:
                    self._on_evict(victims)
            take = min(n, len(self._free))
            got = [self._free.pop() for _ in range(take)] + victims
            self._state[got] = BlockState.LOCKED
            self._locks[got] = 1
            return got

    def lock(self, blocks: Sequence[int]) -> None:
        """Add one lock to each block (LOCKED or CACHED). All-or-nothing."""
        ids = self._ids(blocks, "blocks")
        with self._mutex:
            bad = self._state[ids] == BlockState.FREE
            if bad.any():
                raise UsageError("cannot lock a free block", argument="blocks", block=int(ids[np.argmax(bad)]))
            for b in ids[self._state[ids] == BlockState.CACHED].tolist():
                self._policy.remove(b)
            np.add.at(self._locks, ids, 1)
            self._state[ids] = BlockState.LOCKED

    def unlock(self, blocks: Sequence[int]) -> None:
        """Drop one lock from each block; at zero it becomes CACHED (evictable). All-or-nothing."""
        ids = self._ids(blocks, "blocks")
        with self._mutex:
            counts = np.bincount(ids, minlength=self.num_blocks)[ids]
            bad = self._locks[ids] < counts
            if bad.any():
                raise UsageError("block is not locked", argument="blocks", block=int(ids[np.argmax(bad)]))
            np.subtract.at(self._locks, ids, 1)
            for b in sorted(set(ids.tolist())):  # not np.unique: its first call imports numpy.ma (opens files)
                if self._locks[b] == 0:
                    self._state[b] = BlockState.CACHED
                    self._policy.add(b)

    def free(self, blocks: Sequence[int]) -> None:
        """Return blocks to FREE. Each must be CACHED or hold exactly one lock. All-or-nothing."""
        ids = self._ids(blocks, "blocks", unique=True)
        with self._mutex:
            st, lk = self._state[ids], self._locks[ids]
            bad = (st == BlockState.FREE) | ((st == BlockState.LOCKED) & (lk > 1))
            if bad.any():
                b = int(ids[np.argmax(bad)])
                raise UsageError(
                    "block is free or locked by someone else",
                    argument="blocks",
                    block=b,
                    lock_count=int(self._locks[b]),
                )
            for b in ids.tolist():
                self._policy.remove(b)
                self._free.append(b)
            self._state[ids] = BlockState.FREE
            self._locks[ids] = 0

    def touch(self, blocks: Iterable[int]) -> None:
        """Mark blocks as recently used (affects eviction order of CACHED blocks)."""
        with self._mutex:
            for b in blocks:
                self._policy.touch(int(b))

    def adopt_cached(self, blocks: Sequence[int]) -> None:
        """Move FREE blocks straight to CACHED, oldest first (warm boot recovery)."""
        ids = self._ids(blocks, "blocks", unique=True)
        with self._mutex:
            if (self._state[ids] != BlockState.FREE).any():
                raise UsageError("only free blocks can be adopted", argument="blocks")
            taken = set(ids.tolist())
            self._free = [b for b in self._free if b not in taken]
            self._state[ids] = BlockState.CACHED
            for b in ids.tolist():
                self._policy.add(b)

    # -- helpers -------------------------------------------------------------
    def _check_id(self, b: int, argument: str) -> int:
        if not isinstance(b, (int, np.integer)) or not 0 <= int(b) < self.num_blocks:
            raise UsageError("block id out of range", argument=argument, block=b, num_blocks=self.num_blocks)
        return int(b)

    def _ids(self, blocks: Iterable[int], argument: str, unique: bool = False) -> npt.NDArray[np.int64]:
        try:
            raw = (blocks if isinstance(blocks, np.ndarray) else np.asarray(list(blocks))).reshape(-1)
            if raw.size and raw.dtype.kind not in "iu":  # a plain int64 cast truncates floats, parses strings
                raise TypeError(raw.dtype)
            ids = raw.astype(np.int64)
        except (TypeError, ValueError, OverflowError) as exc:
            raise UsageError("must be a sequence of int block ids", argument=argument) from exc
        if ids.size and ((ids < 0) | (ids >= self.num_blocks)).any():
            bad = ids[(ids < 0) | (ids >= self.num_blocks)][0]
            raise UsageError("block id out of range", argument=argument, block=int(bad), num_blocks=self.num_blocks)
        if unique and len(set(ids.tolist())) != len(ids):
            raise UsageError("block named twice", argument=argument)
        return ids
