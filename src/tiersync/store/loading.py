"""Loads: (storage ->) host -> device (the :class:`Loader` of a :class:`KVCacheStore`).

A load needs every key pinned (one pin per time it is named). Host-resident entries are
copied to the device blocks at once; storage-only entries are first read into fresh host
blocks (promotion), published, then copied. A key named twice has its host block copied
in a second transfer, so no transfer names one source block twice. Success consumes one
pin per key; any failure keeps every pin and reaches the caller through the future.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

from tiersync.errors import IntegrityError, RemoteError, UsageError
from tiersync.store.futures import StoreFuture
from tiersync.store.index import Entry
from tiersync.store.keys import check_keys
from tiersync.store.residency import Residency
from tiersync.tiers.storage import ReadStatus

if TYPE_CHECKING:
    from tiersync.store.demotion import Demoter
    from tiersync.store.holdings import Holdings
    from tiersync.transfer.future import TransferFuture

HOST, STORAGE = Residency.HOST, Residency.STORAGE


class Loader:
    """Loads pinned entries of ``holdings`` into device blocks; ``demoter`` makes host room
    for promotions and sweeps after them."""

    def __init__(self, holdings: Holdings, demoter: Demoter) -> None:
        self._h, self._demoter = holdings, demoter

    def load(self, keys: Sequence[bytes], device_blocks: Sequence[int]) -> StoreFuture[None]:
        """Copy pinned ``keys`` into ``device_blocks``; storage-only entries are promoted to host first.

        Every key must be pinned (by ``lookup``) and loadable, else UsageError naming
        ``keys``. Success consumes one pin per key; failure (CapacityError raised at
        once when promotion finds no host room, or the future raising, e.g.
        IntegrityError for a block that failed its checksum) keeps every pin.
        """
        keys, dev = check_keys(keys), [int(d) for d in device_blocks]
        if len(dev) != len(keys):
            raise UsageError(
                "needs one device block per key", argument="device_blocks", keys=len(keys), blocks=len(dev)
            )
        fut: StoreFuture[None] = StoreFuture()
        if not keys:  # a lookup with no hit loads nothing: done at once (there is no copy to wait for)
            with self._h.lock:
                self._h.check_open()
            fut._settle(None)
            return fut
        self._demoter.room_for_load(keys)  # evict only what is safe on storage (demotion.py)
        with self._h.lock:
            self._h.check_open()
            entries = self._pinned_entries(keys)
            cold = [e for e in dict.fromkeys(entries) if not e.residency & HOST]
            if self._drop_misfits(cold, fut):
                return fut
            blocks = self._h.allocate_host(len(cold)) if cold else []
            self._h.index.hold(entries)
        if not cold:
            self._to_device(entries, dev, fut)
            return fut
        assert self._h.storage is not None  # cold entries have a STORAGE copy
        try:
            rf = self._h.storage.read([e.key for e in cold], [self._h.arena.block(b) for b in blocks])
        except BaseException:  # nothing read: give back the host blocks and the holds, keep the pins
            with self._h.lock:
                self._h.arena.free(blocks)
                self._h.index.unhold(entries)
                self._h.gauge()
            raise
        rf.add_done_callback(lambda f: self._promoted(f, cold, blocks, entries, dev, fut))
        return fut

    def _drop_misfits(self, cold: list[Entry], fut: StoreFuture[None]) -> bool:
        """Storage copies whose stored length is not this store's block size (another layout's
        writer sharing the directory and identity) are never loadable here: this store and this
        process's storage index forget them (the files stay, unlike corrupt ones: other readers
        may use them) and ``fut`` fails (pins kept); True when there were any. Under the lock."""
        storage, n = self._h.storage, self._h.arena.block_nbytes
        misfits = [e for e in cold if storage is not None and storage.stored_length(e.key) not in (None, n)]
        for e in misfits:
            self._h.index.clear(e, STORAGE)
        if misfits:
            assert storage is not None  # misfits were found in it
            storage.forget([e.key for e in misfits])
            self._h.gauge()
            fut._fail(
                IntegrityError("storage block has another size than this store's blocks", key=misfits[0].key.hex())
            )
        return bool(misfits)

    def _pinned_entries(self, keys: list[bytes]) -> list[Entry]:
        """Entries of ``keys``; each needs one pin per time it is named (as in release)."""
        entries: list[Entry] = []
        named: dict[bytes, int] = {}
        for k in keys:
            e = self._h.index.get(k)
            named[k] = named.get(k, 0) + 1
            if e is None or e.pins < named[k] or not e.visible:
                raise UsageError(
                    "key is not pinned (once per time it is named) or not loadable: lookup first",
                    argument="keys",
                    key=k.hex(),
                )
            entries.append(e)
        return entries

    def _promoted(
        self,
        rf: Future[list[ReadStatus]],
        cold: list[Entry],
        blocks: list[int],
        entries: list[Entry],
        dev: list[int],
        fut: StoreFuture[None],
    ) -> None:
        try:
            self._promote_finish(rf, cold, blocks, entries, dev, fut)
        except BaseException as exc:  # noqa: BLE001 - never strand a future
            fut._fail(exc)

    def _promote_finish(
        self,
        rf: Future[list[ReadStatus]],
        cold: list[Entry],
        blocks: list[int],
        entries: list[Entry],
        dev: list[int],
        fut: StoreFuture[None],
    ) -> None:
        exc = rf.exception()
        statuses = [ReadStatus.UNREADABLE] * len(cold) if exc is not None else rf.result()
        with self._h.lock:
            good = [(e, b) for e, b, s in zip(cold, blocks, statuses) if s is ReadStatus.OK]
            bad = [(e, b, s) for e, b, s in zip(cold, blocks, statuses) if s is not ReadStatus.OK]
            if good:
                self._h.arena.publish([b for _, b in good], [e.key for e, _ in good])
                for e, b in good:
                    self._h.index.set_host(e, b)
            for e, b, s in bad:
                self._h.arena.free([b])
                if s is not ReadStatus.UNREADABLE:
                    self._h.index.clear(e, STORAGE)  # gone or corrupt on disk: never served
            if bad:
                self._h.index.unhold(entries)
            self._h.gauge()
        self._h.metrics.promotions.inc(len(good))
        self._h.metrics.bytes.labels("storage", "out").inc(len(good) * self._h.arena.block_nbytes)
        if bad:
            e, _, s = bad[0]
            if s is ReadStatus.CORRUPT:
                self._h.metrics.corrupt.labels("storage").inc(sum(1 for *_, x in bad if x is ReadStatus.CORRUPT))
            fut._fail(_read_error(s, e.key, exc))
            return
        self._to_device(entries, dev, fut)
        self._demoter.maybe_demote()

    def _to_device(self, entries: list[Entry], dev: list[int], fut: StoreFuture[None]) -> None:
        rounds: list[list[tuple[int, int, int]]] = []  # a key loaded twice: its host block in a 2nd copy
        seen: dict[int, int] = {}
        for e, d in zip(entries, dev):
            i = seen[e.block] = seen.get(e.block, -1) + 1
            if i == len(rounds):
                rounds.append([])
            rounds[i].append((e.block, d, 1))
        try:
            tfs = [self._h.engine.h2d(r) for r in rounds]
        except BaseException as exc:  # noqa: BLE001 - pins kept, delivered through the future
            with self._h.lock:
                self._h.index.unhold(entries)
            fut._fail(exc)
            return
        left, errors, gate = [len(tfs)], [], threading.Lock()

        def one(t: TransferFuture) -> None:
            with gate:
                left[0] -= 1
                if t.exception() is not None:
                    errors.append(t.exception())
                last = left[0] == 0
            if last:
                self._loaded(errors[0] if errors else None, entries, fut)

        for tf in tfs:
            tf.add_done_callback(one)

    def _loaded(self, exc: BaseException | None, entries: list[Entry], fut: StoreFuture[None]) -> None:
        with self._h.lock:
            self._h.index.unhold(entries)
            if exc is None:
                self._h.index.unpin([e.key for e in entries])
        if exc is not None:
            fut._fail(exc)
        else:
            self._h.metrics.bytes.labels("host", "out").inc(len(entries) * self._h.arena.block_nbytes)
            fut._settle(None)
            self._demoter.maybe_demote()


def _read_error(status: ReadStatus, key: bytes, exc: BaseException | None) -> Exception:
    if status is ReadStatus.CORRUPT:
        return IntegrityError("storage block failed its checksum; not served", key=key.hex())
    if status is ReadStatus.MISSING:
        return RemoteError("storage block vanished (deleted by another process?)", key=key.hex())
    return RemoteError("storage block unreadable", key=key.hex(), error=repr(exc) if exc else None)
