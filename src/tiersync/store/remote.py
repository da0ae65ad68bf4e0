"""Hooks for a remote tier (store nodes) on a :class:`KVCacheStore` (no networking here).

The store itself never talks to the network. A sweeper of layer 5
(:mod:`tiersync.net.sweep`) uses these three calls:

- :meth:`take_evictable` holds up to ``n`` of the coldest idle host entries (not
  evictable, not demotable, not taken twice) and hands out views of their host blocks;
  the views stay valid until :meth:`give_back`.
- :meth:`give_back` ends a take: ``remote=True`` records a REMOTE copy, ``drop=True``
  frees the host copy of each entry still idle (one pinned meanwhile keeps it).
- :meth:`insert_host` lands bytes fetched from elsewhere (e.g. a store node) in new host
  entries, all-or-nothing.

An entry whose only copy is REMOTE is invisible to ``lookup`` (a hole), until a caller
refills it with :meth:`insert_host`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from tiersync.errors import ClosedError, UsageError
from tiersync.store.residency import Residency

if TYPE_CHECKING:
    from tiersync.store.holdings import Holdings

HOST, REMOTE = Residency.HOST, Residency.REMOTE


class RemoteHooks:
    """The three calls of the module doc, on ``holdings``."""

    def __init__(self, holdings: Holdings) -> None:
        self._h = holdings

    def take_evictable(self, n: int) -> list[tuple[bytes, memoryview]]:
        """Up to ``n`` idle host entries, least recently used first, held until :meth:`give_back`.

        Returns ``(key, view of its host block)`` pairs; ``[]`` when none is evictable.
        """
        if not isinstance(n, int) or n < 0:
            raise UsageError("must be an int >= 0", argument="n", value=n)
        with self._h.lock:
            self._h.check_open()
            taken = self._h.index.coldest(HOST, n)
            self._h.index.hold(taken)
            return [(e.key, self._h.arena.block(e.block)) for e in taken]

    def give_back(self, keys: Sequence[bytes], *, remote: bool = False, drop: bool = False) -> int:
        """End the take of ``keys`` (each exactly as taken); returns how many host blocks were freed.

        ``remote``: a store node now holds them (REMOTE is marked). ``drop``: free each
        host copy whose entry is idle again; a pinned entry keeps its host copy. Entries
        kept count as just used (most recently used in the eviction order).
        """
        with self._h.lock:
            entries = [e for k in keys if (e := self._h.index.get(k)) is not None and e.busy]
            if len(entries) != len(keys):
                raise UsageError("key was not taken (take_evictable first)", argument="keys")
            self._h.index.unhold(entries)
            freed = []
            for e in entries:
                if remote:
                    self._h.index.mark(e, REMOTE, True)
                if drop and e.idle and e.residency & HOST:
                    freed.append(self._h.index.clear_host(e))
            self._h.arena.free(freed)
            self._h.gauge()
        if freed:
            self._h.metrics.evictions.labels("host").inc(len(freed))
        return len(freed)

    def insert_host(
        self, keys: Sequence[bytes], fill: Callable[[list[bytes], list[memoryview]], None]
    ) -> tuple[bytes, ...]:
        """Land ``keys`` absent here (or REMOTE only) in new host entries; returns the keys inserted.

        ``fill(new_keys, views)`` must write each new key's host block (called without the lock).
        Host room comes from free blocks, then by evicting idle entries (CapacityError
        when that is not enough). If ``fill`` raises, every new block is freed, no entry
        is created and the exception propagates.
        """
        keys = list(dict.fromkeys(keys))
        with self._h.lock:
            self._h.check_open()
            new = [k for k in keys if (e := self._h.index.get(k)) is None or not (e.visible or e.pending)]
            if not new:
                return ()
            blocks = self._h.allocate_host(len(new))
            entries = [self._h.index.add_pending(k, b) for k, b in zip(new, blocks)]
        try:
            fill(list(new), [self._h.arena.block(b) for b in blocks])
        except BaseException:
            with self._h.lock:
                self._h.drop_pending(entries, blocks)
            raise
        with self._h.lock:
            if self._h.closed:
                self._h.drop_pending(entries, blocks)
                raise ClosedError("store closed during insert")
            self._h.arena.publish(blocks, new)
            for e in entries:
                self._h.index.commit(e)
            self._h.gauge()
        return tuple(new)
