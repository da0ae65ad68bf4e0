"""A store node's registry agent: register, heartbeat, advertise the hashes it holds.

The agent never fails the node: every registry call is best effort (logged and
retried at the next heartbeat). Rules:

- :meth:`StoreAgent.start` registers the store (id -> address, free/capacity blocks,
  pool group) and publishes every held key, then heartbeats every
  ``heartbeat_interval_s`` from a daemon thread.
- A heartbeat answered False (the registry restarted or forgot us: our TTL passed)
  re-registers and re-publishes everything; so does the first heartbeat that
  reaches the registry after a failed call, and every ``republish_interval_s``
  (so ownership entries never reach their block TTL while we hold the blocks).
- :meth:`announce` publishes newly stored keys at once while the registry answers;
  during an outage it only marks them for the next full re-publish.
- A node that reaches the backend itself (``--registry redis://...``, no ``tiersync
  registry`` process in between) also sweeps it after each heartbeat: records of stores whose
  time ran out go (else, with no registry process, nothing ever removed them, and every lookup
  read them all). Over gRPC the registry process sweeps.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tiersync.errors import TierSyncError, UsageError
from tiersync.net.errors import AuthError
from tiersync.net.registry.base import Registry, StoreInfo

log = logging.getLogger(__name__)

REPUBLISH_S = 1800.0
"""How often an agent re-publishes every key it holds, by default: a registry's block TTL must
be longer (else held blocks drop out of lookups until the next re-publish)."""


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """``store_id``/``address``/``pool_group``: what is registered. Seconds, > 0;
    ``republish_interval_s`` should stay under the registry's ``block_ttl_s`` (3600)."""

    store_id: str
    address: str
    pool_group: str = ""
    heartbeat_interval_s: float = 300.0
    republish_interval_s: float = REPUBLISH_S

    def __post_init__(self) -> None:
        StoreInfo(self.store_id, self.address, 0, self.pool_group)  # validates the record fields
        for name in ("heartbeat_interval_s", "republish_interval_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise UsageError("must be > 0 seconds", argument=f"AgentConfig.{name}", value=value)


class StoreAgent:
    """Keeps ``registry`` informed about one store. Thread-safe.

    ``free_blocks()`` / ``held_keys()`` read the node's state; ``capacity_blocks``
    is reported as is. ``registrations`` counts successful (re-)registrations.
    """

    def __init__(
        self,
        registry: Registry,
        config: AgentConfig,
        *,
        free_blocks: Callable[[], int],
        held_keys: Callable[[], Sequence[bytes]],
        capacity_blocks: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry, self.config = registry, config
        self._free, self._held, self._capacity, self._clock = free_blocks, held_keys, capacity_blocks, clock
        self._lock = threading.Lock()
        self._healthy = False  # the last registry call succeeded
        self._dirty = True  # a full register + publish is due
        self._last_full = 0.0
        self.registrations = 0
        self.incarnation = secrets.randbits(63) + 1
        """This agent's random id in the store record: the entries an earlier process of the same
        store id published are not reported as this one's."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Register now (best effort), then heartbeat from a daemon thread until :meth:`close`."""
        self.beat()
        self._thread = threading.Thread(target=self._run, name=f"registry-agent-{self.config.store_id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.config.heartbeat_interval_s):
            if self.beat():  # an outage is logged once an interval, by the heartbeat
                self.sweep()

    def sweep(self) -> int:
        """Drop expired records where this agent reaches the backend directly (best effort);
        how many went (0 over gRPC: the registry process sweeps)."""
        sweep = getattr(self.registry, "sweep", None)
        if sweep is None:
            return 0
        try:
            return int(sweep())
        except TierSyncError as exc:
            log.warning("sweeping the registry from store %s failed: %s", self.config.store_id, exc)
            return 0

    def beat(self) -> bool:
        """One heartbeat (re-registering when due); True when the registry answered."""
        with self._lock:
            full = (
                self._dirty or not self._healthy or self._clock() - self._last_full >= self.config.republish_interval_s
            )
        try:
            if not full and self.registry.heartbeat(self.config.store_id, self._free()):
                return self._set_health(True)
            self._register_all()
        except TierSyncError as exc:
            what = "refused the token of" if isinstance(exc, AuthError) else "unreachable from"
            log.warning("registry %s store %s: %s", what, self.config.store_id, exc)
            return self._set_health(False)
        return True

    def _register_all(self) -> None:
        cfg = self.config
        info = StoreInfo(cfg.store_id, cfg.address, self._free(), cfg.pool_group, self._capacity, self.incarnation)
        with self._lock:  # before the snapshot: a key stored meanwhile that announce defers marks it again
            self._dirty = False
        self.registry.register_store(info)
        self.registry.publish(cfg.store_id, list(self._held()))
        with self._lock:
            self._healthy, self._last_full = True, self._clock()
            self.registrations += 1

    def _set_health(self, ok: bool) -> bool:
        with self._lock:
            self._healthy = ok
            self._dirty = self._dirty or not ok
        return ok

    def announce(self, keys: Sequence[bytes]) -> None:
        """Advertise newly stored ``keys`` (now if the registry answers, else at the next beat). Never raises."""
        with self._lock:
            if not self._healthy or self._dirty:
                self._dirty = True
                return
        try:
            self.registry.publish(self.config.store_id, list(keys))
        except TierSyncError as exc:
            log.warning("publish from store %s deferred: %s", self.config.store_id, exc)
            self._set_health(False)

    def close(self, *, remove: bool = True) -> None:
        """Stop heartbeating; ``remove``: forget the store in the registry (best effort). Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if remove:
            try:
                self.registry.remove_store(self.config.store_id)
            except TierSyncError as exc:
                log.info("store %s not removed from the registry: %s", self.config.store_id, exc)
