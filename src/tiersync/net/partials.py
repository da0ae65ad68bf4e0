"""Checksums of many whole blocks composed from the blocks' own, without reading them again.

A block server answers a PULL_MANY of many small blocks with one DATA whose checksum covers
their concatenation. Summing it means reading every byte once more on the server for every
read; tsum64 is a Fletcher pair, so the checksum of a concatenation follows from each part's
*partial state* (:func:`~tiersync.transfer.kernel.tsum64_partial`) when every part but the last
is a whole number of 64-byte stripes. :class:`PartialSums` keeps those states per block, keyed
by the block's key and the checksum the server holds for it, so a block's state is computed
once (the first time it is composed) and reused by every later read.

A state is kept only when it agrees with the checksum the server holds for the block: bytes
that changed since that checksum was taken raise :class:`ChangedBlock` (the server refuses the
read, as a reader refuses a single block whose bytes no longer match: a whole block is never
served other than as it was vouched for).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from typing import cast

from tiersync.errors import check_positive_int
from tiersync.net.frames import PayloadChecksum
from tiersync.transfer import kernel

__all__ = ["ChangedBlock", "PartialSums"]

Known = tuple[PayloadChecksum, int] | None


class ChangedBlock(Exception):
    """A block's bytes no longer match the checksum its server holds for it."""

    def __init__(self, key: bytes) -> None:
        super().__init__(f"block {key.hex()} changed since its checksum was taken")
        self.key = key


class PartialSums:
    """tsum64 partial states of whole blocks by (key, checksum); at most ``limit`` of them (the
    oldest dropped first: a block read again after that computes its state again).
    Thread-safe."""

    def __init__(self, limit: int = 1 << 16) -> None:
        check_positive_int(limit, "limit")
        self.limit = limit
        self._states: collections.OrderedDict[tuple[bytes, int], bytes] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._states)

    def composed(self, blocks: Sequence[tuple[bytes, memoryview, Known]]) -> tuple[PayloadChecksum, int] | None:
        """The TSUM64 checksum of the concatenated ``(key, bytes, known checksum)`` blocks, or
        None when it cannot be composed: the native checksum is not built, a block's checksum
        is unknown or of another algorithm, or a block other than the last is not a whole
        number of stripes. Raises :class:`ChangedBlock` when a block's bytes no longer match
        its checksum."""
        if kernel.TSUM64 is None or len(blocks) < 2:
            return None
        tsum = PayloadChecksum.TSUM64
        if any(len(view) % kernel.STRIPE for _, view, _ in blocks[:-1]):
            return None
        states: list[bytes | None] = []
        with self._lock:  # the lock taken once for every block's state
            get = self._states.get
            for key, _, known in blocks:
                if known is None or known[0] is not tsum:
                    return None
                states.append(get((key, known[1])))
        if None in states:  # a block composed for the first time
            states = [self._state(k, v, c[1]) if s is None else s for s, (k, v, c) in zip(states, blocks)]  # type: ignore[index]
        return tsum, kernel.tsum64_compose(cast("list[bytes]", states))

    def _state(self, key: bytes, view: memoryview, checksum: int) -> bytes:
        with self._lock:
            state = self._states.get((key, checksum))
        if state is not None:
            return state
        state = kernel.tsum64_partial(view)
        if kernel.tsum64_compose([state]) != checksum:
            raise ChangedBlock(key)
        self._keep(key, checksum, state)
        return state

    def remember(self, key: bytes, view: memoryview) -> int:
        """The TSUM64 checksum of a block just stored, its partial state kept in the same pass (a
        server that sums what it stores anyway: a later PULL_MANY of it reads no byte again).
        Needs the native checksum (:data:`~tiersync.transfer.kernel.TSUM64`)."""
        state = kernel.tsum64_partial(view)
        checksum = kernel.tsum64_compose([state])
        self._keep(key, checksum, state)
        return checksum

    def _keep(self, key: bytes, checksum: int, state: bytes) -> None:
        with self._lock:
            self._states[(key, checksum)] = state
            while len(self._states) > self.limit:
                self._states.popitem(last=False)
