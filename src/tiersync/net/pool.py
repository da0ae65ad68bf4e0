"""The one client connection pool of every link: idle channels per peer, optionally a cap on
the channels open to one peer.

Store-node clients, decode engines (:mod:`tiersync.disagg`) and samplers
(:mod:`tiersync.weights`) all take their channels here. A channel is handed out again only
while it is fresh (``max_idle_s``) and its peer neither hung up nor spoke while it sat idle
(:meth:`~tiersync.net.transport.Channel.reusable`), so a peer that restarted costs no failed
request. With ``max_open_per_peer`` a caller waits (up to its timeout) for a channel to come
back instead of opening more: a sampler's streams to one trainer shard.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tiersync.errors import ClosedError, RemoteError, UsageError, check_positive_int
from tiersync.net.transport import Channel, Transport

__all__ = ["ChannelPool"]


class ChannelPool:
    """Idle channels per peer, at most ``max_idle_per_peer`` kept, each at most ``max_idle_s``
    seconds (peers not used that long are forgotten); at most ``max_open_per_peer`` open to one
    peer, lent and idle (None: no cap). Thread-safe."""

    def __init__(
        self,
        transport: Transport,
        max_idle_per_peer: int = 8,
        max_idle_s: float = 60.0,
        max_open_per_peer: int | None = None,
    ) -> None:
        check_positive_int(max_idle_per_peer, "max_idle_per_peer")
        check_positive_int(max_open_per_peer, "max_open_per_peer", allow_none=True)
        if isinstance(max_idle_s, bool) or not isinstance(max_idle_s, (int, float)) or not max_idle_s > 0:
            raise UsageError("must be > 0", argument="max_idle_s", value=max_idle_s)
        self._transport = transport
        self._max, self._max_idle_s, self._cap = max_idle_per_peer, max_idle_s, max_open_per_peer
        self._idle: dict[str, list[tuple[float, Channel]]] = {}  # (when given back, channel), oldest first
        self._open: dict[str, int] = {}  # channels open per peer, lent and idle
        self._lent: set[Channel] = set()
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)  # a channel came back or one closed
        self._closed = False
        self._swept = time.monotonic()

    @contextmanager
    def acquire(
        self, address: str, timeout: float | None = None, connect_timeout: float | None = None
    ) -> Iterator[Channel]:
        """A channel to ``address``, returned to the pool afterwards unless it broke: any
        exception closes it (even a refused request may leave answers of others in flight).
        ``timeout``: the most seconds to wait for a free channel under the cap and to connect
        (None: the transport's connect timeout, and no limit on the wait); ``connect_timeout``
        also bounds the connect alone (a caller may wait its whole deadline for a channel others
        hold while a peer that does not answer is given up sooner). Raises RemoteError when none
        became free in time, ClosedError once the pool is closed."""
        channel = self._take(address, timeout, connect_timeout)
        try:
            yield channel
        except BaseException:
            try:
                channel.close()
            finally:
                self._give(address, channel)
            raise
        self._give(address, channel)

    def _take(self, address: str, timeout: float | None, connect_timeout: float | None) -> Channel:
        end = None if timeout is None else time.monotonic() + timeout
        stale: list[Channel] = []
        try:
            with self._lock:
                found = self._idle_or_place(address, end, stale)
        finally:
            for channel in stale:
                channel.close()
        if found is not None:
            return found
        if connect_timeout is not None:
            connect_end = time.monotonic() + connect_timeout
            end = connect_end if end is None else min(end, connect_end)
        return self._connect(address, end)

    def _idle_or_place(self, address: str, end: float | None, stale: list[Channel]) -> Channel | None:
        """Under the lock: a fresh idle channel (lent now), or None with a place counted for a
        new one; waits at the cap until ``end``."""
        while True:
            if self._closed:
                raise ClosedError("channel pool closed", peer=address)
            found = self._fresh(address, stale)
            if found is not None:
                self._lent.add(found)
                return found
            if self._cap is None or self._open.get(address, 0) < self._cap:
                self._open[address] = self._open.get(address, 0) + 1
                return None
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise RemoteError("no connection became free", peer=address, open=self._cap)
            self._freed.wait(left)

    def _connect(self, address: str, end: float | None) -> Channel:
        """A new channel in the place counted for it (given up when the connect fails or the
        pool closed meanwhile)."""
        try:
            channel = self._transport.connect(
                address, timeout=None if end is None else max(0.001, end - time.monotonic())
            )
        except BaseException:
            with self._lock:
                self._forget(address, 1)
            raise
        with self._lock:
            closed = self._closed  # closed (maybe aborting) while it connected
            if closed:
                self._forget(address, 1)
            else:
                self._lent.add(channel)
        if closed:
            channel.close()
            raise ClosedError("channel pool closed", peer=address)
        return channel

    def _fresh(self, address: str, stale: list[Channel]) -> Channel | None:
        """The newest idle channel to ``address`` that may be handed out (under the lock); the
        ones found unfit go to ``stale`` (no longer counted)."""
        idle = self._idle.get(address, [])
        fresh, found = time.monotonic() - self._max_idle_s, None
        while idle and found is None:
            given, channel = idle.pop()
            if given >= fresh and channel.reusable():
                found = channel
            else:
                stale.append(channel)
                self._forget(address, 1)
        if not idle:
            self._idle.pop(address, None)
        return found

    def _forget(self, address: str, n: int) -> None:
        """``n`` channels to ``address`` are no longer open (under the lock)."""
        left = self._open.get(address, 0) - n
        if left > 0:
            self._open[address] = left
        else:
            self._open.pop(address, None)
        self._freed.notify_all()

    def _give(self, address: str, channel: Channel) -> None:
        with self._lock:
            self._lent.discard(channel)
            now = time.monotonic()  # under the lock: each peer's list stays oldest first
            old = self._sweep(now) if now - self._swept > self._max_idle_s / 4 else []
            idle = self._idle.get(address, [])
            while len(idle) >= self._max and idle[0][0] < now - self._max_idle_s:  # stale ones make room
                old.append((address, idle.pop(0)[1]))
            keep = not (self._closed or channel.closed or len(idle) >= self._max)
            if keep:
                self._idle[address] = idle
                idle.append((now, channel))
                self._freed.notify_all()
            else:
                old.append((address, channel))
            for peer, _ in old:
                self._forget(peer, 1)
        for _, stale in old:
            stale.close()

    def _sweep(self, now: float) -> list[tuple[str, Channel]]:
        """Take out every channel idle longer than ``max_idle_s`` (under the lock) and forget
        peers left with none."""
        self._swept, old = now, []
        for address in list(self._idle):
            idle = self._idle[address]
            cut = sum(1 for given, _ in idle if given < now - self._max_idle_s)
            old += [(address, channel) for _, channel in idle[:cut]]
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

    def close(self, *, abort: bool = False) -> None:
        """Close the idle channels and refuse new ones; a lent channel is closed when it comes
        back, or now with ``abort`` (its request then fails with PeerClosedError, or ClosedError
        where it had not begun)."""
        with self._lock:
            self._closed = True
            channels = [c for idle in self._idle.values() for _, c in idle] + (list(self._lent) if abort else [])
            for address, idle in self._idle.items():
                self._forget(address, len(idle))
            self._idle.clear()
            self._freed.notify_all()
        for channel in channels:
            channel.close()
