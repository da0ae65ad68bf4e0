"""A sampler's control link to one trainer shard: the channel and what it announced."""

from __future__ import annotations

import logging

from tiersync.errors import TierSyncError, UsageError
from tiersync.net.errors import AuthError, ProtocolError, ProtocolFault, RequestError, log_level
from tiersync.net.tcp import TcpChannel, TcpTransport
from tiersync.weights.config import TransportKind
from tiersync.weights.manifest import Manifest
from tiersync.weights.ops import Register, Welcome
from tiersync.weights.segment import SegmentReader

__all__ = ["ShardLink"]

log = logging.getLogger(__name__)


class ShardLink:
    """The control channel to one trainer shard and what it announced."""

    def __init__(self, rank: int, address: str) -> None:
        self.rank, self.address = rank, address
        self.channel: TcpChannel | None = None
        self.transport = TransportKind.TCP
        self.manifests: dict[int, Manifest] = {}
        self.ready: dict[int, int] = {}
        self.alive = False
        self.readers: dict[str, SegmentReader] = {}  # segment path -> mapping (latest last)

    def register(self, transport: TcpTransport, hello: Register, timeout: float) -> None:
        """Connect, send ``hello`` (its request id is replaced) and take the W_WELCOME: the
        transport granted. AuthError (token/TLS refused), UsageError (transport refused),
        RemoteError (unreachable) or ProtocolError."""
        try:
            channel = self.channel = transport.connect(self.address)
        except AuthError as exc:
            raise AuthError(
                f"trainer shard {self.rank} refused the link ({exc.message}); ReceiverConfig.token "
                "and tls must match its PublisherConfig",
                peer=self.address,
            ) from None
        hello = Register(
            channel.new_request_id(), hello.label, hello.rank, hello.host, hello.transport, hello.relay, hello.zero_copy
        )
        try:
            welcome = channel.request(hello, timeout=timeout)
        except RequestError as exc:
            raise UsageError(f"trainer shard {self.rank} refused: {exc.message}", argument="transport") from None
        if not isinstance(welcome, Welcome) or welcome.source_rank != self.rank:
            raise ProtocolError(
                "expected W_WELCOME from this source rank", fault=ProtocolFault.UNEXPECTED, peer=self.address
            )
        self.transport, self.alive = welcome.transport, True

    def send(self, event: object, timeout: float) -> None:
        """Send one-way message ``event`` (thread-safe); a failure is logged: the control reader
        notices the lost link."""
        try:
            self.channel.send(event, timeout=timeout)
        except TierSyncError as exc:
            log.log(log_level(exc), "%s to trainer shard %s failed: %s", type(event).__name__, self.rank, exc)
