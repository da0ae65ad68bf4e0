"""A sampler's control link to one trainer shard: the channel and what it announced."""
from __future__ import annotations

import logging

from tiersync.errors import TierSyncError
from tiersync.net.errors import log_level
from tiersync.net.tcp import TcpChannel
from tiersync.weights.config import TransportKind
from tiersync.weights.manifest import Manifest
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

    def send(self, event: object, timeout: float) -> None:
        """Send one-way message ``event`` (thread-safe); a failure is logged: the control reader
        notices the lost link."""
        try:
            self.channel.send(event, timeout=timeout)
        except TierSyncError as exc:
            log.log(log_level(exc), "%s to trainer shard %s failed: %s", type(event).__name__, self.rank, exc)
