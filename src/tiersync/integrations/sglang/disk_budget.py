"""How many HiCache pages one namespace keeps on disk, and which go first.

With no bound the disk tier grew until the disk was full: then every write failed (SGLang's L3
stored nothing new) and whatever else lived on that disk failed with it. :class:`DiskBudget`
bounds it at ``disk_bytes``: before pages are written, the least recently used pages of this
namespace are deleted to make room (pages this process never touched, e.g. left by an earlier
run, count as older than any it did, oldest segment first). Thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from tiersync.tiers.storage import StorageTier

__all__ = ["DiskBudget"]


class DiskBudget:
    """The least recently used pages of ``storage`` beyond ``max_bytes`` (None: no bound)."""

    def __init__(self, storage: StorageTier, max_bytes: int | None) -> None:
        self._storage, self._max_bytes = storage, max_bytes
        self._recent: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    def used(self, keys: Sequence[bytes]) -> None:
        """``keys`` were just written or read: the last to go (nothing to track with no bound)."""
        if self._max_bytes is None:
            return
        with self._lock:
            for k in keys:
                self._recent[k] = None
                self._recent.move_to_end(k)

    def room(self, page_nbytes: int, incoming: Sequence[bytes]) -> int:
        """Delete the least recently used pages so that ``incoming`` (new keys, each of
        ``page_nbytes``) fit; how many of them may be written (all, unless they alone are more
        than the bound: then the first that fit)."""
        if self._max_bytes is None:
            return len(incoming)
        cap = self._max_bytes // max(1, page_nbytes)
        fit = min(len(incoming), cap)
        with self._lock:
            excess = self._storage.num_blocks + fit - cap
            if excess <= 0:
                return fit
            keep, recent = set(incoming[:fit]), self._recent
            for k in [k for k in recent if not self._storage.contains(k)]:  # deleted elsewhere (a clear)
                del recent[k]
            stored = self._storage.keys()  # oldest segment first
            older = [k for k in stored if k not in recent and k not in keep]
            victims = (older + [k for k in recent if k not in keep])[:excess]
            for k in victims:
                recent.pop(k, None)
        self._storage.delete(victims)
        return fit
