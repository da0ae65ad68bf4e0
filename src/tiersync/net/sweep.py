"""The evict sweep from a serving host to store nodes, and the read-back that fills lookup holes.

Sweep (:meth:`RemoteTier.sweep`): when the serving store's free host blocks fall
under ``low_watermark`` (fraction of its host blocks), the coldest idle host
entries are taken in batches of at most ``batch`` (<= 128) and offered to the
registry's placement targets (same pool group first, then most free blocks).
A target that refuses (full: a store node never evicts for a remote) or fails
(dead, timed out) is skipped for the next one. After COMMITTED, ALL_EXIST or
PARTIAL_EXIST (COMMITTED for the rest) the batch is on that node: each entry is
marked REMOTE and its host copy freed (unless it was pinned meanwhile). When no
target takes a batch it is evicted locally. The sweep stops once
``high_watermark`` of the blocks are free, or nothing is evictable.

Read-back (:meth:`RemoteTier.fill`): the keys after the first local miss are
looked up in the registry; runs of keys with a common owner are read from that
store node straight into new host blocks (all-or-nothing per run, next owner on
a failure), so the following ``lookup`` finds them. A registry outage or a dead
node only makes the filled prefix shorter; ``fill`` never raises for them.

Needs 16-byte keys (the wire and registry format; ``block_keys`` makes them).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tiersync.errors import (
    CapacityError,
    RemoteError,
    TierSyncError,
    UsageError,
    check_positive_int,
)
from tiersync.net import store_ops as so
from tiersync.net.config import coerce_token
from tiersync.net.errors import log_level
from tiersync.net.registry.base import Registry, StoreInfo
from tiersync.net.store_client import StoreNodeClient
from tiersync.net.tls import TlsConfig
from tiersync.store.kvstore import KVCacheStore
from tiersync.store.residency import LOADABLE

log = logging.getLogger(__name__)
MAX_BATCH = 128


@dataclass(frozen=True, slots=True)
class SweepConfig:
    """Watermarks are fractions of the store's host blocks (``0 <= low <= high <= 1``).

    ``batch``: most blocks per offer (1..128). ``max_targets``: placement targets
    asked for per batch. ``timeout_s``: deadline of one push or read. ``token`` /
    ``bind_host`` / ``tls``: as for :class:`StoreNodeClient`.
    """

    low_watermark: float = 0.03
    high_watermark: float = 0.05
    batch: int = MAX_BATCH
    pool_group: str = ""
    max_targets: int = 4
    timeout_s: float = 30.0
    token: bytes | str | None = None
    bind_host: str = "127.0.0.1"
    tls: TlsConfig | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "token", coerce_token(self.token, "SweepConfig.token"))
        if self.tls is not None and (not isinstance(self.tls, TlsConfig) or self.tls.certfile is None):
            raise UsageError(  # a sweep pushes: the nodes dial its listener, which serves TLS with it
                "must be a TlsConfig with certfile and keyfile, or None", argument="SweepConfig.tls"
            )
        if not 0.0 <= self.low_watermark <= self.high_watermark <= 1.0:
            raise UsageError(
                "needs 0 <= low_watermark <= high_watermark <= 1",
                argument="SweepConfig.low_watermark",
                low=self.low_watermark,
                high=self.high_watermark,
            )
        check_positive_int(self.batch, "SweepConfig.batch")
        if self.batch > MAX_BATCH:
            raise UsageError(f"must be <= {MAX_BATCH}", argument="SweepConfig.batch", value=self.batch)
        check_positive_int(self.max_targets, "SweepConfig.max_targets")
        if not self.timeout_s > 0:
            raise UsageError("must be > 0 seconds", argument="SweepConfig.timeout_s", value=self.timeout_s)


@dataclass(slots=True)
class SweepReport:
    """What one sweep did. ``batches``: sizes taken, in order; ``remote``: store id -> blocks
    placed there; ``local``: blocks evicted with no target; ``refused`` / ``failed``: store ids
    that refused (full) or failed, one per attempt; ``partial``: batches answered PARTIAL_EXIST;
    ``freed``: host blocks freed."""

    batches: list[int] = field(default_factory=list)
    remote: dict[str, int] = field(default_factory=dict)
    local: int = 0
    refused: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    partial: int = 0
    freed: int = 0


class RemoteTier:
    """Store nodes as the tier below ``store``'s host DRAM, found through ``registry``.

    ``client(address)`` makes the :class:`StoreNodeClient` for one node (default: from
    ``config``). :meth:`sweep` and :meth:`fill` may be called from any thread; sweeps
    are serialised. :meth:`start` runs sweeps from a background thread.
    """

    def __init__(
        self,
        store: KVCacheStore,
        registry: Registry,
        config: SweepConfig | None = None,
        *,
        client: Callable[[str], StoreNodeClient] | None = None,
    ) -> None:
        self.store, self.registry = store, registry
        self.config = config or SweepConfig()
        self._client = client or self._default_client
        self._sweep_lock = threading.Lock()
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None
        self._done = threading.Condition()
        self.sweeps = 0  # sweeps that moved something

    def _default_client(self, address: str) -> StoreNodeClient:
        cfg = self.config
        return StoreNodeClient(address, token=cfg.token, timeout=cfg.timeout_s, bind_host=cfg.bind_host, tls=cfg.tls)

    # -- the sweep ------------------------------------------------------------
    def _marks(self) -> tuple[int, int]:
        n = self.store.arena.num_blocks
        return math.ceil(self.config.low_watermark * n), math.ceil(self.config.high_watermark * n)

    def needed(self) -> bool:
        """True when free host blocks are under the low watermark."""
        return self.store.stats().host_free_blocks < self._marks()[0]

    def sweep(self) -> SweepReport:
        """One sweep (nothing happens at or above the low watermark); see the module docstring."""
        report = SweepReport()
        low, high = self._marks()
        with self._sweep_lock:
            free = self.store.stats().host_free_blocks
            if free >= low:
                return report
            for _ in range(self.store.arena.num_blocks // self.config.batch + 2):  # bounded
                if free >= high:
                    break
                taken = self.store.take_evictable(min(self.config.batch, high - free))
                if not taken:
                    break
                self._move(taken, report)
                free = self.store.stats().host_free_blocks
        if report.batches:
            with self._done:
                self.sweeps += 1
                self._done.notify_all()
        return report

    def _move(self, taken: list[tuple[bytes, memoryview]], report: SweepReport) -> None:
        keys = [k for k, _ in taken]
        report.batches.append(len(keys))
        try:
            target = self._place(keys, [v for _, v in taken], report)
        except BaseException:
            self.store.give_back(keys)  # keep the host copies: nothing was placed
            raise
        report.freed += self.store.give_back(keys, remote=target is not None, drop=True)
        if target is None:
            report.local += len(keys)
        else:
            report.remote[target] = report.remote.get(target, 0) + len(keys)

    def _place(self, keys: list[bytes], views: list[memoryview], report: SweepReport) -> str | None:
        """Offer the batch to each placement target in turn; the store id that took it, or None."""
        try:
            targets = self.registry.placement_targets(self.config.pool_group, self.config.max_targets)
        except TierSyncError as exc:  # a registry that raises on an outage: no target
            log.warning("no placement targets: %s", exc)
            targets = []
        for target in targets:
            try:
                result = self._client(target.address).offer_and_push(keys, views)
            except CapacityError:
                report.refused.append(target.store_id)
                continue
            except (RemoteError, UsageError) as exc:  # UsageError: a registry entry no client can use (its address)
                log.log(log_level(exc), "store node %s failed a sweep push: %s", target.store_id, exc)
                report.failed.append(target.store_id)
                continue
            if result.offer is so.OfferStatus.PARTIAL_EXIST:
                report.partial += 1
            return target.store_id
        return None

    # -- background -----------------------------------------------------------
    def start(self, interval_s: float = 1.0) -> None:
        """Check the watermark every ``interval_s`` (or at :meth:`trigger`) and sweep when needed."""
        if not interval_s > 0:
            raise UsageError("must be > 0 seconds", argument="interval_s", value=interval_s)
        if self._thread is not None:
            raise UsageError("already started", argument="interval_s")
        self._thread = threading.Thread(target=self._run, args=(interval_s,), name="remote-sweep", daemon=True)
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        while not self._stop.is_set():
            self._wake.wait(interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                if self.needed():
                    self.sweep()
            except Exception:
                log.exception("remote sweep failed")

    def trigger(self) -> None:
        """Wake the background sweeper now."""
        self._wake.set()

    def wait_sweeps(self, count: int, timeout: float) -> bool:
        """Block until ``count`` sweeps moved something; False on timeout."""
        with self._done:
            return self._done.wait_for(lambda: self.sweeps >= count, timeout)

    def close(self) -> None:
        """Stop the background sweeper (idempotent); the store and registry stay open."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    # -- read-back --------------------------------------------------------------
    def fill(self, keys: Sequence[bytes]) -> int:
        """Fill the hole of ``keys``' local prefix from store nodes; returns the blocks inserted.

        Pins nothing (call ``store.lookup`` afterwards). Host room comes as for a save
        (CapacityError when none can be made). Never raises for a registry or node failure.
        """
        keys = list(keys)
        local = self.store.residency(keys)
        start = next((i for i, r in enumerate(local) if not r & LOADABLE), len(keys))
        rest = keys[start:]
        if not rest:
            return 0
        try:
            owners = self.registry.lookup(rest)
        except TierSyncError as exc:
            log.warning("registry lookup failed; nothing filled: %s", exc)
            return 0
        filled, i, failed = 0, 0, set[str]()
        while i < len(rest):
            j, common = _run(owners, i, self.config.batch, failed)
            if not common:
                break
            if self._fetch(rest[i:j], common):
                filled, i = filled + (j - i), j
            else:  # the same keys again without them: a run may have hidden owners of parts of it
                failed.update(common)
        return filled

    def _fetch(self, keys: list[bytes], owners: list[str]) -> bool:
        """Read ``keys`` from the first of ``owners`` that serves them all; False when none did."""
        nbytes = self.store.arena.block_nbytes
        for owner in owners:
            try:
                info = self.registry.get_store(owner)
                if info is None:
                    continue
                client = self._client(info.address)

                def land(
                    new: list[bytes], views: list[memoryview], client: StoreNodeClient = client, info: StoreInfo = info
                ) -> None:  # called before the loop moves on
                    sizes = client.read(new, views)
                    if len(sizes) != len(new) or any(s != nbytes for s in sizes):
                        raise RemoteError("remote block has another size", peer=info.address, need=nbytes)

                self.store.insert_host(keys, land)
                return True
            except (RemoteError, UsageError) as exc:  # UsageError: a registry entry no client can use
                log.log(log_level(exc), "read-back from %s failed: %s", owner, exc)
        return False


def _run(owners: list[tuple[str, ...]], i: int, limit: int, failed: set[str]) -> tuple[int, list[str]]:
    """End of the run of keys from ``i`` (at most ``limit``) sharing an owner not in ``failed``,
    and those owners (ordered; none when key ``i`` has no other)."""
    common, j = set(owners[i]) - failed, i + 1
    while common and j < len(owners) and j - i < limit and common & set(owners[j]):
        common &= set(owners[j])
        j += 1
    return j, [o for o in owners[i] if o in common]
