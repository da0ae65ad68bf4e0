"""Transport interface (TCP today; UCX/NIXL later).

A :class:`Transport` opens authenticated :class:`Channel` s to peers and serves a
:class:`~tiersync.net.service.Service`; :class:`~tiersync.net.pool.ChannelPool` keeps them
per peer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from tiersync.errors import UsageError
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
