"""A sampler's control link to one trainer shard: the connection and what it announced."""
from __future__ import annotations

import threading

from tiersync.weights.config import TransportKind
from tiersync.weights.manifest import Manifest
from tiersync.weights.segment import SegmentReader

__all__ = ["ShardLink"]


class ShardLink:
    """The control connection to one trainer shard and what it announced."""

    def __init__(self, rank: int, address: str) -> None:
        self.rank, self.address = rank, address
        self.sock = None
        self.transport = TransportKind.TCP
        self.manifests: dict[int, Manifest] = {}
        self.ready: dict[int, int] = {}
        self.alive = False
        self.send_lock = threading.Lock()
        self.readers: dict[str, SegmentReader] = {}  # segment path -> mapping (latest last)
