"""Where and how a store node pulls an OFFER's blocks: from the IP the writer connects from.

A writer serves its blocks on a listener of its own and names it in the OFFER ("host:port").
The node dials only the IP it sees the writer's connection come from, so an authenticated
writer cannot make the node connect anywhere else (its scanner, its relay); it dials with a
descriptor it keeps in reserve when connections fill its table (:mod:`~tiersync.net.spare_fd`),
and ends the pulls under way when it closes (:class:`WriterPulls`).
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from typing import cast

from tiersync.errors import ClosedError, RemoteError, TierSyncError
from tiersync.net import events as ev
from tiersync.net import store_ops as so
from tiersync.net.config import TcpConfig, parse_address
from tiersync.net.pull_plan import Item
from tiersync.net.socket_io import Deadline
from tiersync.net.source import BlockError
from tiersync.net.spare_fd import SpareDescriptor
from tiersync.net.tcp import TcpChannel, TcpTransport

__all__ = ["WriterPulls", "writer_address"]

log = logging.getLogger(__name__)

PULL_WINDOW = 8  # pulls in flight from a writer


class WriterPulls:
    """How a store node pulls OFFERs' blocks from their writers. :meth:`close` ends every pull
    under way at once (each fails with ClosedError, so a node that closes does not wait out a
    slow writer's ``pull_timeout_s``; one still dialing ends within ``connect_timeout_s``, the
    most a dial takes) and refuses later ones."""

    def __init__(self, config: TcpConfig) -> None:
        self._config, self._spare = config, SpareDescriptor()  # to dial while connections fill the table
        self._lock = threading.Lock()
        self._open: set[TcpChannel] = set()
        self._closed = False

    def pull(self, writer: str, lease_id: int, items: list[Item], timeout_s: float) -> None:
        """Pull ``items`` ((key, offset, destination)) from the writer at ``writer`` under its
        lease ``lease_id`` within ``timeout_s``, then release the lease: RemoteError when it
        ended first, ClosedError once :meth:`close` ran."""
        deadline = Deadline(timeout_s, writer)
        if self._closed:  # a pull queued behind the others, taken as the node closes
            raise ClosedError("the store node is closing", peer=writer)
        dial = min(deadline.remaining(), self._config.connect_timeout_s)  # what close() may wait for
        channel = self._spare.call(lambda: TcpTransport(self._config).connect(writer, timeout=dial))
        with self._lock:
            closed = self._closed
            if not closed:
                self._open.add(channel)
        try:
            if closed:
                raise ClosedError("the store node is closing", peer=writer)
            channel.pull_many(lease_id, items, window=PULL_WINDOW, timeout=deadline.remaining())
            done = channel.request(so.Release(channel.new_request_id(), lease_id), timeout=deadline.remaining())
            if cast(ev.CommitReply, done).status is not ev.CommitStatus.COMMITTED:
                raise RemoteError("writer's lease was lost before the pull finished", peer=writer)
        except TierSyncError:
            if self._closed:
                raise ClosedError("the store node closed during the pull", peer=writer) from None
            raise
        finally:
            with self._lock:
                self._open.discard(channel)
            channel.close()

    def close(self) -> None:
        """End the pulls under way (idempotent)."""
        with self._lock:
            self._closed, channels = True, list(self._open)
        for channel in channels:
            channel.close()  # thread-safe: the pull's receive fails at once
        self._spare.close()


def writer_address(source: str, peer: str | None) -> str:
    """The address to pull an OFFER's blocks from: the IP the writer's connection comes from
    (``peer``, "ip:port") and the port ``source`` ("host:port") names. An empty host takes that
    IP; any other host must be that IP written out, so an authenticated writer cannot make the
    node connect anywhere else. BlockError(BAD_REQUEST, why) otherwise.
    """
    host, sep, port = source.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise BlockError(ev.ErrorCode.BAD_REQUEST, f"OFFER source {source!r} is not 'host:port'")
    seen = _ip(parse_address(peer)[0]) if peer is not None else None
    if seen is None:
        raise BlockError(ev.ErrorCode.BAD_REQUEST, "the writer's own address is unknown")
    named = _ip(host.strip("[]")) if host else seen
    if named is None or named.packed != seen.packed:  # scopes aside: the node dials the one it saw
        raise BlockError(
            ev.ErrorCode.BAD_REQUEST,
            f"OFFER source host {host!r} is not {seen}, the address this connection comes from "
            "(the node dials only that one: serve on it, or connect from it)",
        )
    return f"[{seen}]:{port}" if seen.version == 6 else f"{seen}:{port}"


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``text`` as an IP address (an IPv4-mapped IPv6 one as IPv4), or None when it is not one."""
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return mapped or ip
