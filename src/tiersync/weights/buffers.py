"""A sampler's weights: one or two host buffer sets and an atomic version switch.

With two sets, a sync fills the *standby* set while readers use the *active* one, and
:meth:`VersionedBuffers.commit` swaps them under a lock: a reader that acquired version v
(:meth:`acquire` -> :class:`WeightsLease`) keeps reading a complete, unchanging v until it
releases the lease; a later sync waits (up to a deadline) for every lease on the set it is
about to overwrite. With one set, a sync waits for the readers to leave and new readers
wait for the sync to end, so nobody ever reads a half-updated model either; an aborted
single-buffer sync leaves no weights (acquire waits for the next good version).

A commit may also pass *views* (zero-copy: read-only arrays over a version's shared-memory
segment) that stand in for some of the set's own arrays. Once such a version is neither
active nor leased, ``on_release(source, version)`` is called (outside the lock): from then on
this sampler reads nothing of it, and the trainer may rewrite its segment (``source``: what
the commit named, the trainer incarnations the views are of).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from tiersync.errors import CapacityError, ClosedError, UsageError
from tiersync.weights.tensors import allocate

__all__ = ["VersionedBuffers", "WeightsLease"]


class WeightsLease:
    """Read access to one complete version until :meth:`release` (or the ``with`` block ends).

    ``tensors`` maps each name to a read-only numpy array of the sampler's local shard.
    """

    def __init__(self, owner: VersionedBuffers, index: int, version: int, tensors: Mapping[str, np.ndarray]):
        self._owner, self._index = owner, index
        self.version = version
        self.tensors = tensors
        self._released = False

    def identity(self, base: Any) -> Any:
        """``base`` (a :class:`tiersync.store.keys.CacheIdentity`) with ``weights_version`` set to
        this version, so KV computed with older weights is never reused."""
        return replace(base, weights_version=str(self.version))

    def release(self) -> None:
        """Give the version back; idempotent."""
        if not self._released:
            self._released = True
            self._owner._release(self._index)

    def __enter__(self) -> WeightsLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class VersionedBuffers:
    """``count`` (1 or 2) sets of host arrays for the tensors given to :meth:`ensure`.

    ``allocator(local_shape, dtype_name)`` makes each array (C-contiguous, that shape and
    dtype, or uint8 with a trailing itemsize dimension); its contents need not be zero, since a
    sync writes every byte before the set becomes readable. Default: :func:`allocate`.
    """

    def __init__(
        self,
        count: int,
        allocator: Callable[[tuple[int, ...], str], np.ndarray] = allocate,
        on_release: Callable[[tuple[int, ...], int], None] | None = None,
    ) -> None:
        if count not in (1, 2):
            raise UsageError("must be 1 or 2", argument="buffers", value=count)
        if not callable(allocator):
            raise UsageError("must be callable", argument="allocator")
        self._count, self._allocate = count, allocator
        self._sets: list[dict[str, np.ndarray]] = []
        self._specs: dict[str, tuple[tuple[int, ...], str]] | None = None
        self._version: list[int | None] = [None] * count
        self._readers = [0] * count
        self._active: int | None = None
        self._writing: int | None = None
        self._pending: int | None = None
        self._closed = False
        self._cond = threading.Condition()
        self._on_release = on_release
        self._views: list[dict[str, np.ndarray]] = [{} for _ in range(count)]
        self._held: list[tuple[tuple[int, ...], int] | None] = [None] * count  # (source, version) of set i's views
        self._unheld: list[tuple[tuple[int, ...], int]] = []  # to report to on_release (outside the lock)

    def ensure(self, specs: Mapping[str, tuple[tuple[int, ...], str]]) -> None:
        """Allocate the sets for ``specs`` (name -> local shape, dtype) on first use; later calls
        must pass the same specs (UsageError otherwise)."""
        specs = dict(specs)
        with self._cond:
            if self._specs is not None:
                if specs != self._specs:
                    raise UsageError("the model changed shape between versions", argument="manifest")
                return
            self._sets = [{n: self._allocate(s, d) for n, (s, d) in specs.items()} for _ in range(self._count)]
            self._specs = specs

    @property
    def version(self) -> int | None:
        """The active version (None before the first commit or after a failed single-buffer sync)."""
        with self._cond:
            return None if self._active is None else self._version[self._active]

    @property
    def writing(self) -> int | None:
        """The set a sync is writing (None outside a sync)."""
        with self._cond:
            return self._writing

    def active_set(self) -> tuple[int, dict[str, np.ndarray]] | None:
        """``(index, arrays)`` of the active set while another one is written (a delta sync
        copies unchanged chunks out of it; nobody writes it meanwhile); None otherwise."""
        with self._cond:
            if self._active is None or self._active == self._writing:
                return None
            return self._active, self._sets[self._active]

    def begin_write(self, timeout: float) -> tuple[int, dict[str, np.ndarray]]:
        """The set a sync may overwrite, once no lease holds it. CapacityError after ``timeout``."""
        end = time.monotonic() + timeout
        with self._cond:
            if self._writing is not None:
                raise UsageError("a sync is already writing", argument="sync")
            index = 0 if self._count == 1 or self._active is None else 1 - self._active
            self._pending = index  # new readers of this set wait: a sync is not starved
            try:
                while self._readers[index] and not self._closed:
                    left = end - time.monotonic()
                    if left <= 0:
                        raise CapacityError(
                            "readers still hold the buffer a sync must write",
                            requested=1,
                            used=self._readers[index],
                            free=0,
                            version=self._version[index],
                        )
                    self._cond.wait(left)
            finally:
                self._pending = None
                self._cond.notify_all()
            self._check_open()
            self._writing = index
            self._version[index] = None
            self._drop_views(index)
            if self._active == index:  # single buffer: the live weights are about to change
                self._active = None
            out = index, self._sets[index]
        self._fire()
        return out

    def commit(
        self, index: int, version: int, views: Mapping[str, np.ndarray] | None = None, source: tuple[int, ...] = ()
    ) -> None:
        """Make set ``index`` (filled by the sync) the active version, atomically. ``views``:
        name -> array (the set's shape and dtype) read instead of the set's own array; ``source``
        is passed on to ``on_release``."""
        with self._cond:
            if self._writing != index:
                raise UsageError("commit of a set that is not being written", argument="index", value=index)
            self._version[index] = version
            self._active, self._writing = index, None
            if views:
                self._views[index], self._held[index] = dict(views), (source, version)
            for other in range(self._count):
                if other != index and not self._readers[other]:
                    self._drop_views(other)
            self._cond.notify_all()
        self._fire()

    def _drop_views(self, index: int) -> None:
        held = self._held[index]
        if held is not None:
            self._unheld.append(held)
        self._views[index], self._held[index] = {}, None

    def _fire(self) -> None:
        with self._cond:
            versions, self._unheld = self._unheld, []
        if self._on_release is not None:
            for source, v in versions:
                self._on_release(source, v)

    def abort(self, index: int) -> None:
        """Drop a failed sync of set ``index``; the active version (if any) stays."""
        with self._cond:
            if self._writing == index:
                self._writing = None
                self._cond.notify_all()

    def acquire(self, timeout: float | None = None) -> WeightsLease:
        """A lease on the active version, waiting for one up to ``timeout`` (None: forever).

        CapacityError when no version is active by then; ClosedError once closed.
        """
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while (self._active is None or self._pending == self._active) and not self._closed:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise CapacityError("no weights version is active yet", requested=1, used=0, free=0)
                self._cond.wait(left)
            self._check_open()
            index = self._active
            assert index is not None  # the wait ends with a set active unless closed (raised above)
            version = self._version[index]
            assert version is not None  # an active set holds the version committed into it
            self._readers[index] += 1
            views, served = {}, self._views[index]
            for name, arr in self._sets[index].items():
                view = served.get(name, arr).view()
                view.flags.writeable = False
                views[name] = view
            return WeightsLease(self, index, version, views)

    def _release(self, index: int) -> None:
        with self._cond:
            self._readers[index] -= 1
            if not self._readers[index] and index != self._active and index != self._writing:
                self._drop_views(index)
            self._cond.notify_all()
        self._fire()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the receiver is closed", argument="receiver")

    def close(self) -> None:
        """Refuse new leases and drop the sets (leases already taken keep their arrays alive)."""
        with self._cond:
            self._closed = True
            self._sets = []
            self._views = [{} for _ in range(self._count)]
            self._cond.notify_all()
