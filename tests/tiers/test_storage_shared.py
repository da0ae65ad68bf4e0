"""Two processes sharing one storage directory use each other's blocks (through the store)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from _storage_helpers import IDENT, block_bytes, key
from tiersync.layout.adapters import kv_layout
from tiersync.store import KVCacheStore, Residency, StoreConfig
from tiersync.tiers.storage import StorageConfig, StorageTier

CHILD = os.path.join(os.path.dirname(__file__), "_storage_child.py")
NB = 8192


@pytest.fixture
def shared_dir():
    d = tempfile.mkdtemp(prefix="tiersync-shared-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def spawn(*args):
    return subprocess.Popen(
        [sys.executable, CHILD, *args], stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True, bufsize=1
    )


def test_two_processes_share_blocks(shared_dir):
    dev = np.zeros((8, NB), dtype=np.uint8)
    layout = kv_layout([dev])
    assert layout.host_block_nbytes == NB
    cfg = StoreConfig(host_blocks=4, low_watermark=1.0, high_watermark=1.0)  # demote everything
    storage = StorageTier(StorageConfig(shared_dir, IDENT, workers=2))
    writer = spawn("write", shared_dir, "peer", str(NB))
    reader = spawn("serve", shared_dir)
    try:
        assert writer.stdout.readline().strip() == "READY"
        assert reader.stdout.readline().strip() == "READY"
        with KVCacheStore(layout, cfg, storage=storage) as store:
            # the other process's blocks: found on a lookup miss, loaded byte-exact
            theirs: list[bytes] = []
            for _ in range(3):
                theirs += [bytes.fromhex(i.split(":")[0]) for i in writer.stdout.readline().split()[1:]]
            hit = store.lookup(theirs)
            assert hit.keys == tuple(theirs) and set(hit.residency) == {Residency.STORAGE}
            n = min(len(theirs), 4)
            store.load(hit.keys[:n], range(n)).result(10)
            store.release(hit.keys[n:])
            for i, k in enumerate(theirs[:n]):
                assert dev[i].tobytes() == block_bytes(k, NB)
            # our blocks: saved, demoted to storage, read by the other process
            ours = [key(i, "parent") for i in range(3)]
            for i, k in enumerate(ours):
                dev[i] = np.frombuffer(block_bytes(k, NB), dtype=np.uint8)
            store.save(range(3), ours).result(10)
            assert store.wait_demotions(10)
            assert all(r & Residency.STORAGE for r in store.residency(ours)), store.residency(ours)
        reader.stdin.write(" ".join(f"{k.hex()}:{NB}" for k in ours) + "\n")
        reader.stdin.flush()
        assert reader.stdout.readline().split() == ["OK"] * 3
        reader.stdin.write(f"{key(12345, 'nobody').hex()}:{NB}\n")
        reader.stdin.flush()
        assert reader.stdout.readline().split() == ["MISS"]
    finally:
        for p in (writer, reader):
            p.kill()
            p.wait()
