"""Transport interface (TCP today; UCX/NIXL later) and transport-independent helpers.

A :class:`Transport` opens authenticated :class:`Channel` s to peers and serves a
:class:`~tiersync.net.service.Service`. :class:`ChannelPool` keeps idle channels per peer
(the one client connection pool of every link), and :func:`pull_striped` splits one block
transfer across several streams.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from tiersync.errors import ClosedError, UsageError
from tiersync.net import store_ops as so
from tiersync.net.service import Service


class Channel(ABC):
    """One authenticated connection to ``peer``. Thread-safe: requests are serialised."""

    peer: str

    @abstractmethod
    def request(self, event: object, *, timeout: float | None = None, into: memoryview | None = None) -> object:
        """Send request ``event`` and return the peer's first answer.

        ``into``: for a PULL, the destination buffer (exact size) the payload lands
        in without an intermediate copy. Raises RequestError when the peer answers
        ERROR, NetTimeoutError past the deadline, PeerClosedError/ProtocolError on a
        broken connection (the channel is then closed), ClosedError when closed.
        """

    def pull_many(
        self,
        lease_id: int,
        items: Sequence[tuple[bytes, int, memoryview]],
        *,
        window: int = 8,
        timeout: float | None = None,
    ) -> None:
        """Pull ``(key, offset, dest)`` items under ``lease_id``, each payload straight into its
        ``dest`` (exact size). Transports that can keep ``window`` requests in flight do
        (:meth:`TcpChannel.pull_many`); this default pulls one by one, each under ``timeout``.
        Raises like :meth:`request`.
        """
        if window < 1:
            raise UsageError("must be >= 1", argument="window", value=window)
        for key, offset, dest in items:
            self.request(so.Pull(self.new_request_id(), lease_id, key, offset, len(dest)), timeout=timeout, into=dest)

    @abstractmethod
    def new_request_id(self) -> int:
        """A request id not used before on this channel (nonzero)."""

    @abstractmethod
    def next_answer(self, request_id: int, *, timeout: float | None = None) -> object:
        """Wait for a further answer to ``request_id`` (e.g. COMMIT_REPLY after ACCEPT)."""

    @abstractmethod
    def close(self) -> None:
        """Close the connection; idempotent."""

    @property
    @abstractmethod
    def closed(self) -> bool:
        """True once closed (by us or because the connection broke)."""

    def reusable(self) -> bool:
        """Whether a pool may hand this idle channel out again (by default: not closed)."""
        return not self.closed


class Server(ABC):
    address: str

    @abstractmethod
    def close(self) -> None:
        """Stop accepting, close every connection; idempotent."""


class Transport(ABC):
    @abstractmethod
    def connect(self, address: str, *, timeout: float | None = None) -> Channel:
        """Open and authenticate a channel. Raises AuthError, NetTimeoutError, PeerClosedError."""

    @abstractmethod
    def serve(self, address: str, service: Service) -> Server:
        """Listen on ``address`` ("host:port", port 0 picks one) and serve ``service``."""


class ChannelPool:
    """Idle channels per peer, at most ``max_idle_per_peer`` kept, each at most ``max_idle_s``
    seconds: an older one, or one whose peer hung up or spoke meanwhile
    (:meth:`Channel.reusable`), is closed instead of handed out, so a peer that restarted
    costs no failed request, and peers not used for ``max_idle_s`` are forgotten. Thread-safe."""

    def __init__(self, transport: Transport, max_idle_per_peer: int = 8, max_idle_s: float = 60.0) -> None:
        if max_idle_per_peer < 1:
            raise UsageError("must be >= 1", argument="max_idle_per_peer")
        if not max_idle_s > 0:
            raise UsageError("must be > 0", argument="max_idle_s", value=max_idle_s)
        self._transport = transport
        self._max, self._max_idle_s = max_idle_per_peer, max_idle_s
        self._idle: dict[str, list[tuple[float, Channel]]] = {}  # (when given back, channel), oldest first
        self._lock = threading.Lock()
        self._closed = False
        self._swept = time.monotonic()

    @contextmanager
    def acquire(self, address: str) -> Iterator[Channel]:
        """A channel to ``address``; returned to the pool unless it broke."""
        channel = self._take(address) or self._transport.connect(address)
        try:
            yield channel
        except BaseException:
            channel.close()
            raise
        self._give(address, channel)

    def _take(self, address: str) -> Channel | None:
        stale: list[Channel] = []
        found = None
        with self._lock:
            if self._closed:
                raise ClosedError("channel pool closed")
            idle = self._idle.get(address, [])
            fresh = time.monotonic() - self._max_idle_s
            while idle and found is None:
                given, channel = idle.pop()
                if given >= fresh and channel.reusable():
                    found = channel
                else:
                    stale.append(channel)
            if not idle:
                self._idle.pop(address, None)
        for channel in stale:
            channel.close()
        return found

    def _give(self, address: str, channel: Channel) -> None:
        with self._lock:
            now = time.monotonic()  # under the lock: each peer's list stays oldest first
            old = self._sweep(now) if now - self._swept > self._max_idle_s / 4 else []
            idle = self._idle.get(address, [])
            while len(idle) >= self._max and idle[0][0] < now - self._max_idle_s:  # stale ones make room
                old.append(idle.pop(0)[1])
            keep = not (self._closed or channel.closed or len(idle) >= self._max)
            if keep:
                self._idle[address] = idle
                idle.append((now, channel))
        for stale in old if keep else [*old, channel]:
            stale.close()

    def _sweep(self, now: float) -> list[Channel]:
        """Take out every channel idle longer than ``max_idle_s`` (under the lock) and forget
        peers left with none."""
        self._swept, old = now, []
        for address in list(self._idle):
            idle = self._idle[address]
            cut = sum(1 for given, _ in idle if given < now - self._max_idle_s)
            old += [channel for _, channel in idle[:cut]]
            if cut == len(idle):
                del self._idle[address]
            else:
                del idle[:cut]
        return old

    def idle_count(self, address: str) -> int:
        with self._lock:
            return len(self._idle.get(address, []))

    def peers(self) -> int:
        """How many peers the pool holds idle channels to."""
        with self._lock:
            return len(self._idle)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channels = [c for idle in self._idle.values() for _, c in idle]
            self._idle.clear()
        for channel in channels:
            channel.close()


def split_ranges(length: int, streams: int, min_chunk: int = 1 << 20) -> list[tuple[int, int]]:
    """Split ``length`` bytes into at most ``streams`` contiguous (offset, size) parts."""
    if streams < 1:
        raise UsageError("must be >= 1", argument="streams")
    parts = max(1, min(streams, -(-length // max(1, min_chunk))))
    step = -(-length // parts) if length else 0
    return [(off, min(step, length - off)) for off in range(0, length, step)] if length else [(0, 0)]


def pull_striped(
    pool: ChannelPool,
    address: str,
    lease_id: int,
    key: bytes,
    dest: memoryview,
    *,
    streams: int = 4,
    min_chunk: int = 1 << 20,
    timeout: float | None = None,
) -> None:
    """Pull block ``key`` (``len(dest)`` bytes) under ``lease_id`` into ``dest`` over several streams.

    Each part travels on its own pooled channel, landing straight in its slice
    of ``dest`` (:meth:`~tiersync.net.tcp.TcpChannel.pull_many`: over TCP in pieces no larger
    than the agreed frame limit, or a same-host read as the channel's route says). Raises the
    first part's error (RemoteError subclasses) after every part has finished.
    """
    view = memoryview(dest).cast("B")
    ranges = split_ranges(len(view), streams, min_chunk)

    def one(part: tuple[int, int]) -> None:
        offset, size = part
        with pool.acquire(address) as channel:
            channel.pull_many(lease_id, [(key, offset, view[offset : offset + size])], timeout=timeout)

    if len(ranges) == 1:
        one(ranges[0])
        return
    with ThreadPoolExecutor(max_workers=len(ranges)) as pool_exec:
        futures = [pool_exec.submit(one, part) for part in ranges]
    for future in futures:
        future.result()
