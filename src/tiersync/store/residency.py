"""Where an entry's bytes are, and the status of store operations."""

from __future__ import annotations

import enum

from tiersync.completion import Status


class Residency(enum.IntFlag):
    """Tiers holding a copy of an entry. The store tracks HOST and STORAGE itself;
    DEVICE and REMOTE are recorded for callers (:meth:`KVCacheStore.mark`)."""

    NONE = 0
    DEVICE = 1
    HOST = 2
    STORAGE = 4
    REMOTE = 8


LOADABLE = Residency.HOST | Residency.STORAGE


OpStatus = Status
"""A store operation's status: :class:`tiersync.completion.Status` (the one status of every handle)."""
