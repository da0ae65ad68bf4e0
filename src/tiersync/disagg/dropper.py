"""Telling prefill ranks that no decode rank will read a request (KV_DROP).

A decode engine's scheduler learns of a prefilled request from its ``kv_transfer_params`` and
may never read it: the request was aborted while it waited (its client went away), or the
engine computes the prompt itself (another prompt or inputs, another block size, or its own
prefix cache already holds it). A decode rank's read may also fail before it reached, or
finished with, every prefill rank of the request (:class:`~tiersync.disagg.consumer.KVConsumer`).
Unless told, each prefill rank keeps the request's blocks until its ``timeout_s`` (vLLM's
``load_timeout_s``, 120 s): under load, the blocks of every abandoned request.
:class:`KVDropper` tells them, off the caller's thread: :data:`SENDERS` threads send KV_DROP
over pooled connections that prove this side's token (and TLS, as the consumer's reads do),
each within ``config.connect_timeout_s`` + ``config.io_timeout_s`` (a pooled connection the
rank closed meanwhile is tried once more, on a new one). Each rank's drops wait in a lane of
their own, sent in order by one sender at a time: a rank that accepts and never answers holds
one sender, never the drops to the other ranks (unless :data:`SENDERS` ranks hang at once).
A rank that cannot be reached, refuses, or no longer knows the request (read, being read, or
timed out meanwhile) is logged and skipped; one that failed is not tried again for
:data:`BACKOFF_S`, doubled at each further failure up to :data:`BACKOFF_MAX_S` and reset by a
success (a rank that keeps hanging costs a sender and a connection ever more rarely): its
timeout frees the blocks as before. At most :data:`MAX_PENDING` drops wait to be sent to one
rank, and :data:`MAX_WAITING` to all of them together; a rank whose lane is full is not sent
more (logged once until no drop waits), the others still are: a rank that hangs holds its own
lane, never the drops to the others. A drop is an optimisation, never needed for correctness.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from tiersync.disagg.config import DisaggConfig
from tiersync.disagg.ops import KV, KvDrop
from tiersync.errors import TierSyncError, UsageError
from tiersync.net import events as ev
from tiersync.net.errors import PeerClosedError
from tiersync.net.pool import ChannelPool
from tiersync.net.tcp import TcpChannel, TcpTransport

__all__ = ["BACKOFF_MAX_S", "BACKOFF_S", "MAX_FAILED", "MAX_PENDING", "MAX_WAITING", "SENDERS", "KVDropper"]

log = logging.getLogger(__name__)

MAX_PENDING = 4096
"""Drops waiting to be sent to one prefill rank, at most."""

MAX_WAITING = 1 << 16
"""Drops waiting to be sent, counted rank by rank, to all prefill ranks together, at most (not
counting those a sender took: at most :data:`SENDERS` lanes of :data:`MAX_PENDING`)."""

BACKOFF_S = 30.0
"""How long a prefill rank that failed a drop is not tried again (after its first failure)."""

BACKOFF_MAX_S = 480.0
"""... doubled at each consecutive failure, up to this."""

MAX_FAILED = 4096
"""Prefill ranks whose failures are remembered (for their backoff), at most."""

SENDERS = 4
"""Threads sending drops: ranks served at once (each rank by one of them at a time)."""


@dataclass(eq=False, slots=True)
class _Drop:
    """One :meth:`KVDropper.drop`: its request, and how many of its ranks are still to be told."""

    kv_request: str
    left: int


class KVDropper:
    """Sends KV_DROPs on its own threads; :meth:`drop` never blocks. Close with :meth:`close`."""

    def __init__(self, config: DisaggConfig | None = None) -> None:
        self.config = config if config is not None else DisaggConfig()
        if not isinstance(self.config, DisaggConfig):
            raise UsageError("must be a DisaggConfig", argument="config")
        self._pool = ChannelPool(TcpTransport(self.config.tcp_config(server=False), KV))
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # senders wait here for a lane
        self._settled = threading.Condition(self._lock)  # flush waits here for drops to be done
        self._lanes: dict[str, collections.deque[_Drop]] = {}  # address -> drops waiting for it
        self._ready: collections.deque[str] = collections.deque()  # lanes waiting for a sender
        self._busy: set[str] = set()  # lanes a sender serves now (drops coming meanwhile wait)
        self._open: dict[_Drop, None] = {}  # drops not yet told or given up everywhere, oldest first
        self._waiting = 0  # drops in the lanes, rank by rank
        self._confirmed = 0
        self._overflowed = self._closed = False
        # address -> (when it may be tried again, wait), in the order of their last failure
        self._failed: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()
        self._threads: list[threading.Thread] = []
        try:
            for _ in range(SENDERS):
                thread = threading.Thread(target=self._run, name="tiersync-kv-drop", daemon=True)
                thread.start()
                self._threads.append(thread)
        except RuntimeError:  # no thread to be had: nothing of this dropper is left running
            self.close()
            raise

    @property
    def confirmed(self) -> int:
        """Drops a prefill rank confirmed (the request was pending there and is freed now)."""
        with self._lock:
            return self._confirmed

    def drop(self, kv_request: str, addresses: Sequence[str]) -> None:
        """Tell the prefill ranks at ``addresses`` that request ``kv_request`` (their id of it)
        will not be read. Raises UsageError naming ``kv_request`` or ``addresses``; after
        :meth:`close` the drop is not sent; not to a rank with :data:`MAX_PENDING` drops waiting
        (nor to any with :data:`MAX_WAITING` waiting in all)."""
        KvDrop(0, kv_request)  # the id as the wire carries it (UsageError naming kv_request)
        targets = () if isinstance(addresses, (str, bytes)) else tuple(addresses)
        if not targets or not all(isinstance(a, str) and a for a in targets):
            raise UsageError("must be a sequence of host:port strings", argument="addresses")
        ranks = tuple(dict.fromkeys(targets))  # a rank named twice is told once
        with self._lock:
            if self._closed:
                return
            drop, fresh = _Drop(kv_request, 0), 0
            for address in ranks:
                lane = self._lanes.get(address)
                if self._waiting >= MAX_WAITING or (lane is not None and len(lane) >= MAX_PENDING):
                    self._full(address)
                    continue
                if lane is None:
                    lane = self._lanes[address] = collections.deque()
                    if address not in self._busy:
                        self._ready.append(address)
                        fresh += 1
                lane.append(drop)
                drop.left += 1
                self._waiting += 1
            if drop.left:
                self._open[drop] = None
            self._work.notify(fresh)

    def _full(self, address: str) -> None:
        """A drop to ``address`` is not queued (its lane, or all of them, full); logged once
        until no drop waits. Called with the lock held."""
        if not self._overflowed:
            everywhere = self._waiting >= MAX_WAITING
            most, to = (MAX_WAITING, "") if everywhere else (MAX_PENDING, f" to {address}")
            log.warning("%d KV drops wait to be sent%s: more are not sent", most, to)
        self._overflowed = True

    def flush(self, timeout: float) -> bool:
        """Wait until every drop asked for so far was sent (or given up); False after ``timeout`` s."""
        with self._lock:
            if self._closed:
                return not any(t.is_alive() for t in self._threads)
            waiting = list(self._open)

            def sent() -> bool:
                while waiting and waiting[-1] not in self._open:
                    waiting.pop()
                return not waiting

            return self._settled.wait_for(sent, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Stop (drops not yet sent are not sent) and close the idle connections, waiting at most
        ``timeout`` s (default ``config.connect_timeout_s``) in all for drops being sent (one
        still going ends within its ``io_timeout_s`` on its own: the senders are daemons).
        Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lanes.clear()  # what waits will not be sent
            self._waiting = 0
            self._ready.clear()
            self._open.clear()
            self._work.notify_all()
            self._settled.notify_all()
        end = time.monotonic() + (self.config.connect_timeout_s if timeout is None else timeout)
        for thread in self._threads:
            thread.join(timeout=max(0.0, end - time.monotonic()))
        self._pool.close()  # the channel of a drop still being sent is closed when it ends

    # -- the senders ---------------------------------------------------------------------------
    def _run(self) -> None:
        while (lane := self._take()) is not None:
            address, drops = lane
            for drop in drops:
                if not self._closed:
                    try:
                        self._send(drop.kv_request, address)
                    except Exception:  # e.g. an address getaddrinfo cannot encode: the sender must not end
                        log.exception("dropping %s at %s failed", drop.kv_request, address)
                        self._backoff(address)
                self._told(drop)
            with self._lock:
                self._busy.discard(address)
                if address in self._lanes:  # more came while it was served: its turn again
                    self._ready.append(address)
                    self._work.notify()

    def _take(self) -> tuple[str, list[_Drop]] | None:
        """A lane no other sender serves and the drops waiting in it; None once closed."""
        with self._lock:
            self._work.wait_for(lambda: self._closed or bool(self._ready))
            if self._closed:
                return None
            address = self._ready.popleft()
            self._busy.add(address)
            drops = list(self._lanes.pop(address))
            self._waiting -= len(drops)
            return address, drops

    def _told(self, drop: _Drop) -> None:
        """One rank of ``drop`` was told (or given up); the drop is done once all of them were."""
        with self._lock:
            drop.left -= 1
            if drop.left <= 0 and drop in self._open:
                del self._open[drop]
                self._overflowed = self._overflowed and bool(self._open)
                self._settled.notify_all()

    def _backoff(self, address: str) -> float:
        """``address`` failed: the seconds it is not tried again (doubling while it keeps failing)."""
        with self._lock:
            now = time.monotonic()
            last = self._failed.pop(address, None)
            # one whose wait ended BACKOFF_MAX_S ago starts afresh
            wait = BACKOFF_S if last is None or last[0] + BACKOFF_MAX_S <= now else min(2 * last[1], BACKOFF_MAX_S)
            self._failed[address] = (now + wait, wait)
            # bounded (addresses come from requests): those that failed longest ago go first, each once
            while len(self._failed) > MAX_FAILED or next(iter(self._failed.values()))[0] + 2 * BACKOFF_MAX_S <= now:
                self._failed.popitem(last=False)
            return wait

    def _send(self, kv_request: str, address: str) -> None:
        with self._lock:
            if self._failed.get(address, (0.0, 0.0))[0] > time.monotonic():
                return  # failed lately: its timeout frees the request there
        for attempt in (1, 2):
            reused = self._pool.idle_count(address) > 0
            try:
                with self._pool.acquire(address) as pooled:
                    channel = cast(TcpChannel, pooled)  # the pool connects with a TcpTransport
                    req = KvDrop(channel.new_request_id(), kv_request)
                    reply = channel.request(req, timeout=self.config.io_timeout_s)
                break
            except (TierSyncError, OSError) as exc:
                if attempt == 1 and reused and isinstance(exc, PeerClosedError) and not self._closed:
                    continue  # the rank closed the pooled connection meanwhile: once more, on a new one
                wait = self._backoff(address)
                log.info("could not drop %s at %s (its timeout frees it there): %s", kv_request, address, exc)
                log.debug("not trying %s again for %.0f s", address, wait)
                return
        committed = isinstance(reply, ev.CommitReply) and reply.status is ev.CommitStatus.COMMITTED
        with self._lock:
            self._failed.pop(address, None)  # it answers again: a later failure backs off afresh
            self._confirmed += committed
        if not committed:
            log.debug("%s at %s: not dropped (%s)", kv_request, address, getattr(reply, "message", reply))
