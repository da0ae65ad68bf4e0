"""KVCacheStore: save/lookup/load/release contracts, tiers, warm boot, threads, metrics."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading

import numpy as np
import pytest

from _store_helpers import identity, keys_for, make_layout
from tiersync.errors import CapacityError, IntegrityError, UsageError
from tiersync.store import KVCacheStore, OpStatus, Residency, StoreConfig
from tiersync.tiers.host import HostArena
from tiersync.tiers.storage import StorageConfig, StorageTier


def fill(dev, seed):
    dev[:] = np.random.default_rng(seed).integers(0, 256, dev.shape, dtype=np.uint8)
    return dev.copy()


@pytest.fixture
def tmpdir_path():
    d = tempfile.mkdtemp(prefix="tiersync-store-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_save_lookup_load_round_trip(store, dev_layout):
    dev, _ = dev_layout
    ref = fill(dev, 1)
    keys = keys_for(4)
    fut = store.save([0, 1, 2, 3], keys)
    res = fut.result(10)
    assert res.saved == tuple(keys) and res.skipped == () and fut.status is OpStatus.DONE
    again = store.save([0, 1], keys[:2]).result(10)
    assert again.saved == () and again.skipped == tuple(keys[:2])
    hit = store.lookup(keys + keys_for(2, seed=5))
    assert hit.keys == tuple(keys) and not hit.complete and hit.residency == (Residency.HOST,) * 4
    assert [store.pins(k) for k in keys] == [1] * 4
    dev[:] = 0
    store.load(hit.keys, [7, 6, 5, 4]).result(10)
    assert (dev[[7, 6, 5, 4]] == ref[:4]).all()
    assert [store.pins(k) for k in keys] == [0] * 4  # success consumed one pin each


def test_loading_a_lookup_without_hits_completes_at_once_and_changes_nothing(store):
    keys = keys_for(2)
    store.save([0, 1], keys).result(10)
    miss = store.lookup(keys_for(3, seed=9))
    assert miss.keys == ()
    fut = store.load(miss.keys, [])
    assert fut.result(1) is None and fut.status is OpStatus.DONE
    assert [store.pins(k) for k in keys] == [0, 0] and store.lookup(keys).keys == tuple(keys)


def test_prefix_stops_at_first_miss_and_pins_nothing_after(store, dev_layout):
    keys = keys_for(4)
    store.save([0, 1, 3], [keys[0], keys[1], keys[3]]).result(10)
    hit = store.lookup(keys)
    assert hit.keys == tuple(keys[:2])
    assert store.pins(keys[3]) == 0
    store.release(hit.keys)


def test_release_rules(store):
    keys = keys_for(2)
    store.save([0, 1], keys).result(10)
    store.lookup(keys)
    with pytest.raises(UsageError) as ei:
        store.release([keys[0], keys[0]])  # one pin, two releases: refused, nothing changes
    assert ei.value.argument == "keys" and store.pins(keys[0]) == 1
    store.release(keys)
    with pytest.raises(UsageError):
        store.release(keys)
    with pytest.raises(UsageError, match="lookup first"):
        store.load(keys, [0, 1])


def test_insert_never_evicts_pinned_and_is_all_or_nothing(store):
    keys = keys_for(8)
    store.save(range(8), keys).result(10)
    store.lookup(keys[:6])  # 6 pinned, 2 evictable
    with pytest.raises(CapacityError) as ei:
        store.save(range(3), keys_for(3, seed=2))
    assert ei.value.requested == 3
    assert store.stats().host_entries == 8 and all(r == Residency.HOST for r in store.residency(keys))
    store.save(range(2), keys_for(2, seed=2)).result(10)  # evicts exactly the two unpinned, LRU
    assert store.residency(keys[6:]) == [Residency.NONE] * 2
    assert all(store.residency(keys[:6]))
    assert store.metrics.value("tiersync_store_evictions_total", tier="host") == 2


def test_new_weights_version_never_serves_stale_kv(store):
    old = keys_for(3, ident=identity(version="step-1"))
    store.save(range(3), old).result(10)
    new = keys_for(3, ident=identity(version="step-2"))
    assert store.lookup(new).num_hits == 0


def test_concurrent_clients_keep_pins_exact(dev_layout):
    _, layout = dev_layout
    errors = []
    with KVCacheStore(layout, StoreConfig(host_blocks=8)) as store:

        def client(seed):
            rng = np.random.default_rng(seed)
            try:
                for _ in range(60):
                    keys = keys_for(int(rng.integers(1, 4)), seed=int(rng.integers(0, 6)))
                    try:
                        store.save(range(len(keys)), keys).result(10)
                    except CapacityError:
                        pass
                    hit = store.lookup(keys)
                    if hit.keys and rng.random() < 0.5:
                        store.load(hit.keys, range(len(hit.keys))).result(10)
                    elif hit.keys:
                        store.release(hit.keys)
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=client, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors
        assert store.stats().pinned == 0
        assert store.stats().host_entries + store.stats().host_free_blocks == 8


def test_warm_boot_rebuilds_index(dev_layout, tmpdir_path):
    from tiersync.tiers.shm import ShmConfig

    dev, layout = dev_layout
    ref = fill(dev, 3)
    shm = ShmConfig(key="store-test", model_id="tiny@v1", directory=tmpdir_path)
    keys = keys_for(3)
    with KVCacheStore(layout, StoreConfig(host_blocks=8, shm=shm)) as s:
        s.save([0, 1, 2], keys).result(10)
    dev[:] = 0
    with KVCacheStore(layout, StoreConfig(host_blocks=8, shm=shm)) as s:
        hit = s.lookup(keys)
        assert hit.keys == tuple(keys)
        s.load(hit.keys, [0, 1, 2]).result(10)
        assert (dev[:3] == ref[:3]).all()
        assert s.stats().host_free_blocks == 5
    arena = HostArena.for_layout(layout, 8, shm=shm)  # an arena passed in works the same
    with KVCacheStore(layout, StoreConfig(host_blocks=8), arena=arena) as s:
        assert s.lookup(keys).num_hits == 3
    arena.close()


def make_storage(path, layout, **kw):
    return StorageTier(StorageConfig(path, identity(layout).digest(), workers=2, **kw))


def test_demotion_by_watermarks_and_promotion_on_hit(tmpdir_path):
    dev, layout = make_layout(num_blocks=16, nbytes=4096)
    ref = fill(dev, 4)
    cfg = StoreConfig(host_blocks=8, low_watermark=0.3, high_watermark=0.5)
    keys = keys_for(16)
    with KVCacheStore(layout, cfg, storage=make_storage(tmpdir_path, layout)) as s:
        for i in range(0, 16, 4):
            s.save(range(i, i + 4), keys[i : i + 4]).result(10)
            assert s.wait_demotions(10)
        st = s.stats()
        assert st.storage_entries >= 8 and st.host_free_blocks >= 3
        hit = s.lookup(keys)
        assert hit.complete and Residency.STORAGE in hit.residency
        dev[:] = 0
        s.load(hit.keys[:4], range(4)).result(10)  # oldest four: promoted from storage
        assert (dev[:4] == ref[:4]).all()
        s.release(hit.keys[4:])
        assert s.metrics.value("tiersync_store_promotions_total") >= 1
        assert s.metrics.value("tiersync_store_demotions_total") >= 8


def test_storage_capacity_evicts_coldest(tmpdir_path):
    _dev, layout = make_layout(num_blocks=16, nbytes=4096)
    cfg = StoreConfig(host_blocks=4, low_watermark=0.5, high_watermark=1.0, demote_batch=2)
    keys = keys_for(16)
    with KVCacheStore(layout, cfg, storage=make_storage(tmpdir_path, layout, capacity_blocks=6)) as s:
        for i in range(0, 16, 2):
            s.save(range(2), keys[i : i + 2]).result(10)
            assert s.wait_demotions(10)
        assert s.stats().storage_entries <= 6
        assert s.lookup(keys[-2:]).num_hits == 2


def test_corrupt_storage_block_fails_load_keeps_pin_never_serves(tmpdir_path):
    dev, layout = make_layout(num_blocks=4, nbytes=4096)
    fill(dev, 5)
    keys = keys_for(2)
    storage = make_storage(tmpdir_path, layout)
    storage.write(keys, [memoryview(dev[0]), memoryview(dev[1])]).result()
    seg = next(n for n in os.listdir(tmpdir_path) if n.endswith(".seg"))
    with open(os.path.join(tmpdir_path, seg), "r+b") as f:
        f.seek(8192 + 100)
        f.write(b"\xff\x00\xff")
    with KVCacheStore(layout, StoreConfig(host_blocks=4), storage=storage) as s:
        hit = s.lookup(keys)
        assert hit.keys == tuple(keys)
        dev[:] = 7
        with pytest.raises(IntegrityError):
            s.load(hit.keys, [2, 3]).result(10)
        assert s.pins(keys[1]) == 1 and s.pins(keys[0]) == 1  # failed: pins kept
        assert s.residency([keys[1]]) == [Residency.NONE]
        s.release(hit.keys)
        assert s.lookup(keys).num_hits == 1  # the corrupt one is a miss now
        assert s.metrics.value("tiersync_store_corrupt_total", tier="storage") == 1


def test_demotion_sweeps_in_batches_until_the_high_watermark(tmpdir_path):
    """A sweep started under the low watermark goes on, batch after batch, until the high one."""
    dev, layout = make_layout(num_blocks=16, nbytes=4096)
    fill(dev, 5)
    cfg = StoreConfig(host_blocks=16, low_watermark=0.1, high_watermark=0.9, demote_batch=2)
    keys = keys_for(16)
    with KVCacheStore(layout, cfg, storage=make_storage(tmpdir_path, layout)) as s:
        s.save(range(16), keys).result(10)
        assert s.wait_demotions(10)
        st = s.stats()
        assert st.host_free_blocks >= 15, st  # ceil(0.9 * 16) free: seven batches of two, not one
        assert st.storage_entries >= 14


def test_empty_requests_complete_at_once_and_change_nothing():
    """A lookup with no hit, then ``load([], [])`` / ``save([], [])``: futures done at once (a
    script without a timeout must never hang on them)."""
    _, layout = make_layout(num_blocks=4)
    with KVCacheStore(layout, StoreConfig(host_blocks=4)) as store:
        hit = store.lookup(keys_for(2))
        assert not hit.keys
        load, save = store.load([], []), store.save([], [])
        assert load.done() and save.done()
        assert load.result(0) is None and save.result(0).saved == () and save.result(0).skipped == ()
        assert store.residency(keys_for(2)) == [Residency.NONE] * 2
