"""Telling prefill ranks that no decode rank will read a request (KV_DROP).

A decode engine's scheduler learns of a prefilled request from its ``kv_transfer_params`` and
may never read it: the request was aborted while it waited (its client went away), or the
engine computes the prompt itself (another prompt or inputs, another block size, or its own
prefix cache already holds it). Unless told, each prefill rank keeps the request's blocks
until its ``timeout_s`` (vLLM's ``load_timeout_s``, 120 s): under load, the blocks of every
abandoned request. :class:`KVDropper` tells them, off the scheduler's thread: one thread sends
KV_DROP to every prefill rank of the request over pooled connections that prove this side's
token (and TLS, as :class:`~tiersync.disagg.consumer.KVConsumer`'s reads do), each within
``config.connect_timeout_s`` + ``config.io_timeout_s`` (a pooled connection the rank closed
meanwhile is tried once more, on a new one). A rank that cannot be reached, refuses, or no
longer knows the request (read, being read, or timed out meanwhile) is logged and skipped, and
one that failed is not tried again for :data:`BACKOFF_S` (a rank that stopped answering must
not hold up the drops of the others): its timeout frees the blocks as before. At most
:data:`MAX_PENDING` drops wait to be sent; more are not sent (logged once until the queue
empties): a drop is an optimisation, never needed for correctness.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import cast

from tiersync.disagg.config import DisaggConfig
from tiersync.disagg.ops import KV, KvDrop
from tiersync.errors import TierSyncError, UsageError
from tiersync.net import events as ev
from tiersync.net.errors import PeerClosedError
from tiersync.net.pool import ChannelPool
from tiersync.net.tcp import TcpChannel, TcpTransport

__all__ = ["BACKOFF_S", "MAX_PENDING", "KVDropper"]

log = logging.getLogger(__name__)

MAX_PENDING = 4096
"""Drops waiting to be sent, at most."""

BACKOFF_S = 30.0
"""How long a prefill rank that failed a drop is not tried again."""

_Item = tuple[str, tuple[str, ...]] | threading.Event | None  # a drop, a flush marker, stop


class KVDropper:
    """Sends KV_DROPs on its own thread; :meth:`drop` never blocks. Close with :meth:`close`."""

    def __init__(self, config: DisaggConfig | None = None) -> None:
        self.config = config if config is not None else DisaggConfig()
        if not isinstance(self.config, DisaggConfig):
            raise UsageError("must be a DisaggConfig", argument="config")
        self._pool = ChannelPool(TcpTransport(self.config.tcp_config(server=False), KV))
        self._queue: queue.Queue[_Item] = queue.Queue()  # bounded by drop()
        self._lock = threading.Lock()
        self._pending = self._confirmed = 0
        self._overflowed = self._closed = False
        self._failed: dict[str, float] = {}  # address -> when it may be tried again (sender thread only)
        self._thread = threading.Thread(target=self._run, name="tiersync-kv-drop", daemon=True)
        self._thread.start()

    @property
    def confirmed(self) -> int:
        """Drops a prefill rank confirmed (the request was pending there and is freed now)."""
        with self._lock:
            return self._confirmed

    def drop(self, kv_request: str, addresses: Sequence[str]) -> None:
        """Tell the prefill ranks at ``addresses`` that request ``kv_request`` (their id of it)
        will not be read. Raises UsageError naming ``kv_request`` or ``addresses``; after
        :meth:`close`, or with :data:`MAX_PENDING` drops waiting, the drop is not sent."""
        KvDrop(0, kv_request)  # the id as the wire carries it (UsageError naming kv_request)
        targets = () if isinstance(addresses, (str, bytes)) else tuple(addresses)
        if not targets or not all(isinstance(a, str) and a for a in targets):
            raise UsageError("must be a sequence of host:port strings", argument="addresses")
        with self._lock:
            if self._closed:
                return
            if self._pending >= MAX_PENDING:
                if not self._overflowed:
                    log.warning("%d KV drops wait to be sent: later ones are not sent", MAX_PENDING)
                self._overflowed = True
                return
            self._pending += 1
            self._queue.put_nowait((kv_request, targets))

    def flush(self, timeout: float) -> bool:
        """Wait until every drop asked for so far was sent (or given up); False after ``timeout`` s."""
        done = threading.Event()
        with self._lock:
            if self._closed:
                return not self._thread.is_alive()
            self._queue.put_nowait(done)  # set once the thread reaches it
        return done.wait(timeout)

    def close(self) -> None:
        """Stop (drops not yet sent are not sent) and close the idle connections, waiting at most
        ``config.connect_timeout_s`` for a drop being sent (one still going ends within its
        ``io_timeout_s`` on its own: the thread is a daemon). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        while True:  # what waits will not be sent
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, threading.Event):
                item.set()
        self._queue.put(None)
        self._thread.join(timeout=self.config.connect_timeout_s)
        self._pool.close()  # the channel of a drop still being sent is closed when it ends

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if isinstance(item, threading.Event):
                item.set()
                continue
            kv_request, addresses = item
            for address in addresses:
                if self._closed:
                    break
                try:
                    self._send(kv_request, address)
                except Exception:  # e.g. an address getaddrinfo cannot encode: the thread must not end
                    log.exception("dropping %s at %s failed", kv_request, address)
                    self._failed[address] = time.monotonic() + BACKOFF_S
            with self._lock:
                self._pending -= 1
                self._overflowed = self._overflowed and self._pending > 0

    def _send(self, kv_request: str, address: str) -> None:
        now = time.monotonic()
        if self._failed.get(address, 0.0) > now:
            return
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
                log.info("could not drop %s at %s (its timeout frees it there): %s", kv_request, address, exc)
                self._failed = {a: t for a, t in self._failed.items() if t > now}  # bounded: recent failures
                self._failed[address] = now + BACKOFF_S
                return
        self._failed.pop(address, None)
        if isinstance(reply, ev.CommitReply) and reply.status is ev.CommitStatus.COMMITTED:
            with self._lock:
                self._confirmed += 1
        else:
            log.debug("%s at %s: not dropped (%s)", kv_request, address, getattr(reply, "message", reply))
