"""tiersync.weights.links: what a sampler waits for from its trainer shards."""

from __future__ import annotations

import time

import pytest

from tiersync.errors import RemoteError
from tiersync.net.socket_io import Deadline
from tiersync.weights.links import TrainerLinks


def test_a_version_superseded_while_queued_fails_at_once_instead_of_at_the_sync_deadline():
    """Shards announce in order, and a shard keeps only its last manifests: a sampler that fell
    behind and asks for a version a shard announced later ones than, but no longer has, is told
    so at once (it used to wait the whole sync timeout for each such version)."""
    links = TrainerLinks(["127.0.0.1:1", "127.0.0.1:2"], 1.0, lambda version: None)
    shards = links._shards  # no trainer here: stand for what two shards announced
    for shard, versions in zip(shards, ((6, 7, 8, 9, 10), (6, 7, 8))):
        shard.alive = True
        shard.manifests = dict.fromkeys(versions)
    t0 = time.monotonic()
    with pytest.raises(RemoteError, match="superseded"):
        links.manifests(3, Deadline(30.0, "sync"))
    assert time.monotonic() - t0 < 5  # not the 30 s deadline
    with pytest.raises(Exception, match="timed out"):  # 9: shard 1 has not announced it yet, so wait
        links.manifests(9, Deadline(0.3, "sync"))
