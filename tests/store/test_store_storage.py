"""The store over a storage tier: eviction never loses unsaved blocks; scans never block lookups."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest

from _store_helpers import identity, keys_for, make_layout
from tiersync.errors import CapacityError, IntegrityError
from tiersync.store import KVCacheStore, Residency, StoreConfig
from tiersync.tiers.storage import StorageConfig, StorageTier

NO_SWEEP = dict(low_watermark=0.0, high_watermark=0.0)  # the watermark sweep never starts


@pytest.fixture
def sdir():
    d = tempfile.mkdtemp(prefix="tiersync-store-storage-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def fill(dev, seed):
    dev[:] = np.random.default_rng(seed).integers(0, 256, dev.shape, dtype=np.uint8)
    return dev.copy()


def make_storage(path, layout, **kw):
    return StorageTier(StorageConfig(path, identity(layout).digest(), workers=2, **kw))


def test_eviction_writes_unsaved_host_entries_to_storage_first(sdir):
    dev, layout = make_layout(num_blocks=8, nbytes=4096)
    ref = fill(dev, 1)
    keys = keys_for(8)
    with KVCacheStore(layout, StoreConfig(host_blocks=4, **NO_SWEEP), storage=make_storage(sdir, layout)) as s:
        s.save(range(4), keys[:4]).result(10)
        assert s.residency(keys[:4]) == [Residency.HOST] * 4  # no sweep: nothing on storage yet
        s.save(range(4, 8), keys[4:]).result(10)  # needs the first four's host blocks
        assert s.residency(keys[:4]) == [Residency.STORAGE] * 4, s.residency(keys[:4])
        assert s.metrics.value("tiersync_store_evictions_total", tier="host_unsaved") == 0
        assert s.metrics.value("tiersync_store_demotions_total") == 4
        hit = s.lookup(keys[:2])
        assert hit.complete
        s.release(hit.keys)
        # and promotions make room the same way: the four now on host get written down
        hit = s.lookup(keys[:4])
        dev[:] = 0
        s.load(hit.keys, range(4)).result(10)
        assert (dev[:4] == ref[:4]).all()
        assert all(r & Residency.STORAGE for r in s.residency(keys[4:]))
        assert s.metrics.value("tiersync_store_evictions_total", tier="host_unsaved") == 0


def test_failed_write_down_drops_and_counts_the_unsaved(sdir, monkeypatch):
    dev, layout = make_layout(num_blocks=8, nbytes=4096)
    fill(dev, 2)
    keys = keys_for(8)
    storage = make_storage(sdir, layout)

    def full(keys, views):
        raise CapacityError("storage directory is full", requested=len(keys))

    with KVCacheStore(layout, StoreConfig(host_blocks=4, **NO_SWEEP), storage=storage) as s:
        s.save(range(4), keys[:4]).result(10)
        monkeypatch.setattr(storage, "write", full)
        s.save(range(4, 8), keys[4:]).result(10)  # the save still succeeds: a cache evicts locally
        assert s.residency(keys[:4]) == [Residency.NONE] * 4
        assert s.metrics.value("tiersync_store_evictions_total", tier="host_unsaved") == 4
        assert s.metrics.value("tiersync_store_evictions_total", tier="host") == 4


def test_without_storage_eviction_drops_quietly():
    _dev, layout = make_layout(num_blocks=8, nbytes=256)
    keys = keys_for(8)
    with KVCacheStore(layout, StoreConfig(host_blocks=4)) as s:
        s.save(range(4), keys[:4]).result(10)
        s.save(range(4, 8), keys[4:]).result(10)
        assert s.residency(keys[:4]) == [Residency.NONE] * 4
        assert s.metrics.value("tiersync_store_evictions_total", tier="host") == 4
        assert s.metrics.value("tiersync_store_evictions_total", tier="host_unsaved") == 0


def test_lookup_of_host_keys_does_not_wait_for_a_directory_scan(sdir, monkeypatch):
    dev, layout = make_layout(num_blocks=8, nbytes=4096)
    fill(dev, 3)
    keys = keys_for(2)
    other = keys_for(1, seed=9)
    storage = make_storage(sdir, layout)
    with KVCacheStore(layout, StoreConfig(host_blocks=8), storage=storage) as s:
        s.save([0], keys[:1]).result(10)
        with make_storage(sdir, layout) as peer:  # another process's new segment: a scan will read it
            peer.write(other, [memoryview(dev[1])]).result(10)
        entered, release = threading.Event(), threading.Event()
        real_scan = storage._index.scan

        def slow_scan(name):
            entered.set()
            assert release.wait(10)
            return real_scan(name)

        monkeypatch.setattr(storage._index, "scan", slow_scan)
        missing = threading.Thread(target=lambda: s.release(s.lookup(other).keys))
        missing.start()
        try:
            assert entered.wait(10)  # that lookup is scanning now
            done = threading.Event()
            hit = []
            t = threading.Thread(target=lambda: (hit.append(s.lookup(keys[:1])), done.set()))
            t.start()
            assert done.wait(5), "a lookup of a host key waited for the directory scan"
            assert hit[0].complete
            s.release(hit[0].keys)
        finally:
            release.set()
            missing.join(10)
        assert s.lookup(other).complete  # what the scan found is there after it


def test_a_hung_write_down_delays_a_save_by_demote_wait_s_only(sdir, monkeypatch):
    """The caller waits at most demote_wait_s; the entries being written stay on host (their
    blocks are the write's source) and settle onto storage when the write ends."""
    dev, layout = make_layout(num_blocks=8, nbytes=4096)
    ref = fill(dev, 3)
    keys = keys_for(8)
    storage = make_storage(sdir, layout)
    real, gate, entered = storage.write, threading.Event(), threading.Event()

    def slow(keys, views):
        entered.set()
        fut = Future()
        threading.Thread(target=lambda: (gate.wait(60), fut.set_result(real(keys, views).result(60)))).start()
        return fut

    cfg = StoreConfig(host_blocks=4, demote_wait_s=0.2, **NO_SWEEP)
    with KVCacheStore(layout, cfg, storage=storage) as s:
        s.save(range(4), keys[:4]).result(10)
        monkeypatch.setattr(storage, "write", slow)
        with pytest.raises(CapacityError):  # nothing else is evictable: refused, not hung
            s.save(range(4, 8), keys[4:]).result(10)
        assert entered.is_set()
        assert s.residency(keys[:4]) == [Residency.HOST] * 4  # held, not dropped, not reused
        assert s.residency(keys[4:]) == [Residency.NONE] * 4
        gate.set()
        assert s.wait_demotions(30)
        deadline = time.monotonic() + 30
        while not all(r & Residency.STORAGE for r in s.residency(keys[:4])) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(r & Residency.STORAGE for r in s.residency(keys[:4]))
        hit = s.lookup(keys[:4])
        dev[:] = 0
        s.load(hit.keys, range(4)).result(10)
        assert (dev[:4] == ref[:4]).all()
        assert s.metrics.value("tiersync_store_evictions_total", tier="host_unsaved") == 0


def test_a_stored_block_of_another_size_is_dropped_not_leaked(sdir):
    """A writer with the same identity but another block size shares the directory: its record
    (a valid descriptor) cannot be loaded here. Before, every load of it raised at once and
    kept a host block and a hold: the store ran out of host blocks."""
    _, layout = make_layout(num_blocks=4, nbytes=1024)
    keys = keys_for(1)
    other = make_storage(sdir, layout)
    try:
        other.write(keys, [memoryview(bytearray(512))]).result(10)  # half a block of this layout
    finally:
        other.close()
    with KVCacheStore(layout, StoreConfig(host_blocks=4, **NO_SWEEP), storage=make_storage(sdir, layout)) as s:
        free = s.stats().host_free_blocks
        hit = s.lookup(keys)
        assert hit.complete  # the scan indexed it
        with pytest.raises(IntegrityError, match="another size"):
            s.load(hit.keys, [0]).result(10)
        assert s.stats().host_free_blocks == free  # nothing leaked
        s.release(hit.keys)
        assert s.lookup(keys).num_hits == 0  # dropped: never offered again
