"""The worker's half of the connector: it moves bytes between vLLM's KV pool, a host arena
and the disk tier, by the slot numbers the scheduler chose.

Every slot remembers the key last written into it; a load whose slot holds another key (a
save that failed, a disk read that failed) is reported to vLLM as a load error, so vLLM
recomputes those tokens: wrong bytes are never loaded.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tiersync.errors import TierSyncError, UsageError
from tiersync.integrations.vllm.metadata import LoadJob, SaveJob, WorkerReport
from tiersync.integrations.vllm.stats import StatsCounter, TierSyncStats
from tiersync.layout.adapters import kv_layout
from tiersync.store.keys import CacheIdentity
from tiersync.tiers.host import HostArena
from tiersync.tiers.storage import ReadStatus, StorageConfig, StorageTier
from tiersync.transfer.engine import TransferConfig, TransferEngine
from tiersync.transfer.future import TransferFuture

__all__ = ["OffloadWorker", "block_major"]

log = logging.getLogger(__name__)

YIELD_S = 0.002


def block_major(tensor: Any, num_blocks: int, name: str) -> Any:
    """``tensor`` as a view whose first dimension is the block index (vLLM backends put it
    first or second, e.g. ``[2, num_blocks, ...]``). :class:`UsageError` when no dimension
    has ``num_blocks`` entries."""
    shape = tuple(tensor.shape)
    if shape and shape[0] == num_blocks:
        return tensor
    for d, n in enumerate(shape):
        if n == num_blocks:
            return tensor.movedim(d, 0)
    raise UsageError(
        "no dimension is the block index", argument=f"kv_caches[{name!r}]", shape=shape, num_blocks=num_blocks
    )


class OffloadWorker:
    """Executes :class:`LoadJob` / :class:`SaveJob` for one worker (one parallel rank)."""

    def __init__(
        self,
        *,
        identity: CacheIdentity,
        num_slots: int,
        rank: int,
        storage_dir: str | None,
        transfer_workers: int,
        timeout_s: float,
    ) -> None:
        self._identity, self._num_slots, self._rank = identity, num_slots, rank
        self._storage_dir, self._timeout = storage_dir, timeout_s
        self._transfer = TransferConfig(workers=transfer_workers)
        self._layer_index: dict[str, int] = {}
        self._slot_key: list[bytes | None] = [None] * num_slots
        self._engine: TransferEngine | None = None
        self._arena: HostArena | None = None
        self._storage: StorageTier | None = None
        self._load: TransferFuture | None = None
        self._load_blocks: list[int] = []
        self._load_errors: set[int] = set()  # under _lock, as _loaded: the loader thread adds to both
        self._sync_loads: dict[str, tuple[int, ...]] = {}  # this step's loads before the forward, by request
        self._tainted: set[str] = set()  # requests whose saves last step were computed on a failed load
        self._late: dict[int, Any] = {}  # slot -> a disk read into it that outlived its timeout (under _lock)
        self._loaded: set[str] = set()
        self._running = 0  # background loads submitted and not yet reported
        self._load_ended = threading.Event()
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="tiersync-load")
        self._report = WorkerReport()
        self.generation = 0  # weights updates seen (:meth:`weights_updated`)
        self._stats = StatsCounter()  # under _lock: disk writes and loads finish on other threads
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"OffloadWorker(rank={self._rank}, slots={self._num_slots}, layers={len(self._layer_index)})"

    # -- set-up ---------------------------------------------------------------------
    def register(self, kv_caches: Mapping[str, Any], num_blocks: int) -> None:
        """Bind vLLM's per-layer KV tensors (in place) and allocate the host arena."""
        names = list(kv_caches)
        tensors = [block_major(kv_caches[n], num_blocks, n) for n in names]
        layout = kv_layout(tensors)
        self._layer_index = {n: i for i, n in enumerate(names)}
        self._arena = HostArena.for_layout(layout, self._num_slots)
        self._arena.allocator.allocate(self._num_slots)  # every slot is the scheduler's: keep all locked
        self._engine = TransferEngine(layout, self._arena, self._transfer)
        if self._storage_dir is not None:
            directory = os.path.join(self._storage_dir, f"rank{self._rank}")
            self._storage = StorageTier(StorageConfig(directory=directory, identity=self._identity.digest()))

    # -- loads ----------------------------------------------------------------------
    def weights_updated(self) -> None:
        """The model's weights changed: loads planned before the scheduler hears of it (the
        next report) are refused, and the scheduler moves to keys of the new weights."""
        with self._lock:
            self.generation += 1
            self._report.generation = self.generation

    def start_loads(self, jobs: Sequence[LoadJob], generation: int = 0) -> None:
        """Start background jobs (:meth:`_background_load`); stage the others (host hits)
        and post one host->engine copy for all of them, waited layer by layer. Jobs planned
        under an older weights ``generation`` are refused: every block a load error."""
        self._load, self._load_blocks = None, []
        self._sync_loads = {job.req_id: job.device_blocks for job in jobs if not job.background}
        if generation < self.generation:
            return self._refuse(jobs)
        runs, t0 = [], time.perf_counter()
        for job in jobs:
            if job.background:
                with self._lock:
                    self._running += 1
                self._loader.submit(self._background_load, job, generation)
                continue
            good_runs = self._good_runs(job, self._stage(job))
            runs += good_runs
            self._load_blocks += [dev for _, dev, _ in good_runs]
        if runs:
            self._load = self._engine.h2d(runs)
            self._count_load(t0, len(runs))

    def _refuse(self, jobs: Sequence[LoadJob]) -> None:
        with self._lock:
            for job in jobs:
                self._load_errors.update(job.device_blocks)
                if job.background:  # reported finished at once: vLLM then recomputes its blocks
                    self._running += 1
                    self._loaded.add(job.req_id)

    def _good_runs(self, job: LoadJob, good: list[bool]) -> list[tuple[int, int, int]]:
        """(slot, device block, 1) of the job's leading good blocks; the device blocks from
        the first bad one on are load errors (vLLM recomputes from there)."""
        runs = []
        for i, (slot, dev) in enumerate(zip(job.spec.slots, job.device_blocks)):
            if not good[i]:
                with self._lock:
                    self._load_errors.update(job.device_blocks[i:])
                break
            runs.append((slot, dev, 1))
        return runs

    def _background_load(self, job: LoadJob, generation: int) -> None:
        """vLLM's asynchronous load, on the loader thread: disk reads into the slots, one
        host->engine copy, then the request is reported finished (:meth:`finished_loads`),
        with its failed blocks as load errors. vLLM does not schedule the request, nor free
        its blocks, until then; the scheduler keeps the slots pinned until then."""
        t0 = time.perf_counter()
        try:
            runs = self._good_runs(job, self._stage(job))
            if runs:
                load = self._engine.h2d(runs)
                self._count_load(t0, len(runs), load)
                try:
                    load.result(self._timeout)
                except TimeoutError:
                    _wait_out(load)
                    raise
        except (TierSyncError, TimeoutError, OSError):
            with self._lock:
                self._load_errors.update(job.device_blocks)
        finally:
            with self._lock:
                if generation < self.generation:  # the weights changed while it loaded: old KV
                    self._load_errors.update(job.device_blocks)
                self._loaded.add(job.req_id)
                self._load_ended.set()

    def finished_loads(self) -> set[str]:
        """Requests whose background load ended since the last call (vLLM's finished_recving).
        While loads run, an engine with nothing else to do calls this in a busy loop that
        would starve the loader thread: wait (GIL released) for one to end, at most YIELD_S."""
        with self._lock:
            running = self._running
        if running and not self._loaded:
            self._load_ended.wait(YIELD_S)
        with self._lock:
            out, self._loaded = self._loaded, set()
            self._running -= len(out)
            self._load_ended.clear()
        return out

    def _count_load(self, t0: float, blocks: int, load: TransferFuture | None = None) -> None:
        """Count a posted host -> engine copy (``load``, else this step's); its seconds (from
        the first disk read) once it completes."""
        with self._lock:
            self._stats.add("load_bytes_host", blocks * self._arena.block_nbytes)

        def done(f: TransferFuture) -> None:
            with self._lock:
                self._stats.observe("load_seconds", time.perf_counter() - t0)

        (load or self._load).add_done_callback(done)

    def _stage(self, job: LoadJob) -> list[bool]:
        spec = job.spec
        disk = [i for i, d in enumerate(spec.from_storage) if d]
        if disk:
            self._read_disk([spec.keys[i] for i in disk], [spec.slots[i] for i in disk])
        good = [self._slot_key[s] == k for k, s in zip(spec.keys, spec.slots)]
        with self._lock:
            self._report.bad_slots.update(k for k, ok, d in zip(spec.keys, good, spec.from_storage) if not ok and not d)
        return good

    def _read_disk(self, keys: list[bytes], slots: list[int]) -> None:
        for s in slots:
            self._slot_key[s] = None
        late = self._late_slots()  # a read there would race one still writing: not read, a host miss
        todo = [(k, s) for k, s in zip(keys, slots) if s not in late]
        status = self._read_into(todo) if self._storage is not None else [ReadStatus.UNREADABLE] * len(todo)
        bad = set()
        for (k, s), st in zip(todo, status):
            if st is ReadStatus.OK:
                self._slot_key[s] = k
            else:
                bad.add(k)
        with self._lock:
            self._report.bad_disk.update(bad)
            self._report.bad_slots.update(k for k, s in zip(keys, slots) if s in late)
            self._stats.add("load_bytes_disk", (len(todo) - len(bad)) * self._arena.block_nbytes)

    def _read_into(self, todo: list[tuple[bytes, int]]) -> list[ReadStatus]:
        """Read each key into its slot from disk; a read past the timeout is UNREADABLE, and
        its slots are not used until it ended (it still writes into them)."""
        if not todo:
            return []
        assert self._storage is not None  # _read_disk reads only with a storage tier
        read = self._storage.read([k for k, _ in todo], [self._arena.block(s) for _, s in todo])
        try:
            return list(read.result(self._timeout))
        except TimeoutError:
            with self._lock:
                self._late.update((s, read) for _, s in todo)
        except (TierSyncError, OSError):
            pass
        return [ReadStatus.UNREADABLE] * len(todo)

    def wait_layer(self, name: str) -> None:
        """Block until ``name``'s KV of this step's loads is in place. A failed or late
        copy marks every block of the step's loads as a load error."""
        f = self._load
        idx = self._layer_index.get(name)
        if f is None or idx is None:
            return
        try:
            f.wait_layer(idx, timeout=self._timeout)
        except (TierSyncError, TimeoutError, OSError) as exc:
            if isinstance(exc, TimeoutError):
                _wait_out(f)
            with self._lock:
                self._load_errors.update(self._load_blocks)
            self._load = None

    def take_load_errors(self) -> set[int]:
        with self._lock:
            out, self._load_errors = self._load_errors, set()
            self._stats.add("load_errors", len(out))
        return out

    # -- saves ----------------------------------------------------------------------
    def run_saves(self, jobs: Sequence[SaveJob], generation: int = 0) -> None:
        """Copy this step's new full blocks to their slots (synchronously: the engine may
        reuse the blocks after this returns), then start their disk writes. Refused (their
        keys reported bad, so they are misses) are the saves of a step planned under older
        weights (KV of the new weights under the old weights' keys, on disk for an engine
        restarted on the old checkpoint), and those of a request whose load before the forward
        failed, this step or the one before (blocks computed attending to blocks that never
        loaded: vLLM recomputes the request, but these were cached already)."""
        if self._load is not None:  # the forward is over: every layer has been waited
            self._load = None
        with self._lock:
            failed = {r for r, blocks in self._sync_loads.items() if self._load_errors.intersection(blocks)}
        self._sync_loads, tainted, self._tainted = {}, failed | self._tainted, failed
        late = self._late_slots()  # a save there would race a disk read still writing
        refused = [
            j
            for j in jobs
            if generation < self.generation or j.req_id in tainted or any(s in late for s in j.spec.slots)
        ]
        if refused:
            self._refuse_saves(refused)
            jobs = [j for j in jobs if j not in refused]
        runs = [(dev, slot, 1) for job in jobs for dev, slot in zip(job.device_blocks, job.spec.slots)]
        if not runs:
            return
        for job in jobs:
            for s in job.spec.slots:
                self._slot_key[s] = None
        t0 = time.perf_counter()
        copy = self._engine.d2h(runs)
        try:
            copy.result(self._timeout)
        except (TierSyncError, TimeoutError, OSError) as exc:
            if isinstance(exc, TimeoutError):
                _wait_out(copy)  # the slots go back to the scheduler: nothing may write them after
            with self._lock:
                self._report.bad_slots.update(k for job in jobs for k in job.spec.keys)
                self._report.stored_failed.update(k for job in jobs if job.spec.to_storage for k in job.spec.keys)
            return
        with self._lock:
            self._stats.observe("save_seconds", time.perf_counter() - t0)
            self._stats.add("save_bytes_host", len(runs) * self._arena.block_nbytes)
        for job in jobs:
            for k, s in zip(job.spec.keys, job.spec.slots):
                self._slot_key[s] = k
            if job.spec.to_storage:
                self._write_disk(job)

    def _late_slots(self) -> set[int]:
        """Slots a disk read that outlived its timeout still writes into (those that ended are
        forgotten)."""
        with self._lock:
            for s in [s for s, f in self._late.items() if f.done()]:
                del self._late[s]
            return set(self._late)

    def _refuse_saves(self, jobs: Sequence[SaveJob]) -> None:
        """Save nothing of ``jobs``: their slots hold no key, their keys are reported bad (and
        their disk writes failed, which ends the scheduler's holds)."""
        for job in jobs:
            for s in job.spec.slots:
                self._slot_key[s] = None
        with self._lock:
            self._report.bad_slots.update(k for job in jobs for k in job.spec.keys)
            self._report.stored_failed.update(k for job in jobs if job.spec.to_storage for k in job.spec.keys)

    def _write_disk(self, job: SaveJob) -> None:
        keys = list(job.spec.keys)
        if self._storage is None:
            with self._lock:
                self._report.stored_failed.update(keys)
            return
        future = self._storage.write(keys, [self._arena.block(s) for s in job.spec.slots])

        def done(f: Any) -> None:
            with self._lock:
                failed = f.exception() is not None
                (self._report.stored_failed if failed else self._report.stored_ok).update(keys)
                if not failed:
                    self._stats.add("save_bytes_disk", len(keys) * self._arena.block_nbytes)

        future.add_done_callback(done)

    def take_report(self) -> WorkerReport | None:
        with self._lock:
            report, self._report = self._report, WorkerReport()
        return None if report.empty() else report

    def take_stats(self) -> TierSyncStats | None:
        """What this worker did since the last call (vLLM's ``get_kv_connector_stats``)."""
        with self._lock:
            return self._stats.take()

    def close(self) -> None:
        """Finish background loads and disk writes, then release the engine, arena and
        storage. Idempotent."""
        self._loader.shutdown(wait=True)
        for closer in (self._storage, self._engine, self._arena):
            if closer is not None:
                closer.close()
        self._storage = self._engine = self._arena = None


def _wait_out(copy: TransferFuture) -> None:
    """Wait for a copy between host slots and the engine's blocks that outlived its timeout to
    end (no timeout): its failure then frees blocks or slots to others, which a copy still
    writing would overwrite."""
    log.warning("a %s copy outlived its timeout; waiting for it to end", copy.direction.value)
    copy.exception()
