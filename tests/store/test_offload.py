"""OffloadManager: host slots, pins, holds and the disk index of a remote byte mover."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiersync.errors import UsageError
from tiersync.store.offload import OffloadConfig, OffloadManager
from tiersync.store.residency import Residency


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_store_then_lookup_and_load_pins_until_release():
    m = OffloadManager(OffloadConfig(num_slots=4))
    spec = m.prepare_store([k(1), k(2), k(3)])
    assert spec.keys == (k(1), k(2), k(3)) and len(set(spec.slots)) == 3 and not spec.to_storage
    assert m.lookup([k(1), k(2), k(9), k(3)]) == 2  # prefix: stops at the first miss
    load = m.prepare_load([k(1), k(2), k(9)])
    assert load.keys == (k(1), k(2)) and load.slots == spec.slots[:2] and load.from_storage == (False, False)
    assert m.pins(k(1)) == 1
    m.release(load.keys)
    assert m.pins(k(1)) == 0


def test_store_skips_cached_and_duplicate_keys():
    m = OffloadManager(OffloadConfig(num_slots=4))
    m.prepare_store([k(1)])
    spec = m.prepare_store([k(1), k(2), k(2)])
    assert spec.keys == (k(2),)


def test_full_manager_evicts_lru_but_never_pinned():
    m = OffloadManager(OffloadConfig(num_slots=2))
    m.prepare_store([k(1), k(2)])
    pinned = m.prepare_load([k(1)])
    spec = m.prepare_store([k(3)])  # k(2) is the only idle entry
    assert spec.keys == (k(3),) and m.residency(k(2)) == Residency.NONE
    assert m.residency(k(1)) == Residency.HOST and m.evictions == 1
    assert m.prepare_store([k(4)]).keys == (k(4),)  # evicts k(3), still not the pinned k(1)
    m.release(pinned.keys)
    assert m.residency(k(1)) == Residency.HOST


def test_nothing_evictable_gives_a_short_spec_and_changes_nothing():
    m = OffloadManager(OffloadConfig(num_slots=1))
    m.prepare_store([k(1)])
    held = m.prepare_load([k(1)])
    spec = m.prepare_store([k(2), k(3)])
    assert spec.keys == () and m.residency(k(2)) == Residency.NONE and m.num_free_slots == 0
    m.release(held.keys)


def test_storage_writes_hold_slots_until_reported():
    m = OffloadManager(OffloadConfig(num_slots=1, storage=True))
    spec = m.prepare_store([k(1)])
    assert spec.to_storage
    assert m.prepare_store([k(2)]).keys == ()  # k(1)'s slot is still being written to disk
    m.storage_done([k(1)])
    assert m.residency(k(1)) == Residency.HOST | Residency.STORAGE
    assert m.prepare_store([k(2)]).keys == (k(2),)  # k(1) leaves host, stays on disk
    assert m.residency(k(1)) == Residency.STORAGE
    m.storage_done([k(2)])
    load = m.prepare_load([k(1)])  # a disk hit gets a slot (evicting k(2) from host)
    assert load.from_storage == (True,) and m.residency(k(1)) & Residency.HOST
    m.release(load.keys)


def test_failed_disk_write_is_not_a_disk_copy():
    m = OffloadManager(OffloadConfig(num_slots=1, storage=True))
    m.prepare_store([k(1)])
    m.storage_done([], failed=[k(1)])
    assert m.residency(k(1)) == Residency.HOST
    m.prepare_store([k(2)])
    assert m.lookup([k(1)]) == 0


def test_invalidate_turns_hits_into_misses_and_frees_the_slot():
    m = OffloadManager(OffloadConfig(num_slots=2, storage=True))
    m.add_storage([k(1)])
    m.prepare_store([k(2)])
    m.storage_done([k(2)])
    m.invalidate([k(2)])
    assert m.residency(k(2)) == Residency.STORAGE and m.num_free_slots == 2
    m.invalidate([k(1), k(2)], storage=True)
    assert m.lookup([k(1)]) == 0 and m.lookup([k(2)]) == 0


def test_an_invalidated_key_a_load_still_reads_keeps_its_slot_until_released():
    """A request's load of K from disk is under way (K pinned, its slot being filled) when
    another request's host hit on K fails and the worker reports it bad: K stops being a hit,
    but its slot is not handed to the next store while the first load still reads or writes
    it (that store's block and K's bytes would mix: a wrong load, or K's bytes on disk under
    another key). It is free once the load released K; a held one once its disk write ended."""
    m = OffloadManager(OffloadConfig(num_slots=2, storage=True))
    m.add_storage([k(1)])
    load = m.prepare_load([k(1)])
    m.invalidate([k(1)])
    assert m.residency(k(1)) == Residency.STORAGE and m.num_parked_slots == 1  # a disk hit only
    store = m.prepare_store([k(2), k(3)])
    assert store.keys == (k(2),) and load.slots[0] not in store.slots  # the other slot only
    m.release(load.keys)
    assert m.num_parked_slots == 0 and m.num_free_slots == 1
    m.invalidate([k(2)])  # held for its disk write
    assert m.num_parked_slots == 1 and m.prepare_store([k(4)]).slots == (load.slots[0],)
    m.storage_done([], failed=[k(2)])
    assert m.num_parked_slots == 0 and m.num_free_slots == 1


def test_disk_hit_without_a_slot_shortens_the_load():
    m = OffloadManager(OffloadConfig(num_slots=1, storage=True))
    m.add_storage([k(1), k(2)])
    load = m.prepare_load([k(1), k(2)])
    assert load.keys == (k(1),) and m.pins(k(2)) == 0
    m.release(load.keys)


def test_bad_input_is_refused_without_change():
    with pytest.raises(UsageError, match="num_slots"):
        OffloadConfig(num_slots=0)
    with pytest.raises(UsageError, match="policy"):
        OffloadConfig(num_slots=1, policy="mru")
    m = OffloadManager(OffloadConfig(num_slots=2))
    with pytest.raises(UsageError, match=r"keys\[1\]"):
        m.prepare_store([k(1), b"short"])
    assert m.num_free_slots == 2 and m.lookup([k(1)]) == 0
    m.prepare_store([k(1)])
    with pytest.raises(UsageError, match="not pinned"):
        m.release([k(1)])


ops = st.lists(
    st.tuples(
        st.sampled_from(["store", "load", "release", "disk_ok", "disk_bad", "invalidate"]),
        st.lists(st.integers(0, 11), min_size=1, max_size=4),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, slots=st.integers(1, 5), storage=st.booleans())
def test_slots_are_never_shared_and_pins_keep_hosts(ops, slots, storage):
    """Invariant: every slot is free, parked (an invalidated key's, still pinned or held) or
    holds exactly one host-resident key; free + parked + used == num_slots; a parked slot is
    nobody's host copy."""
    m = OffloadManager(OffloadConfig(num_slots=slots, storage=storage))
    pinned: list[bytes] = []
    slot_of: dict[bytes, int] = {}
    for op, ids in ops:
        keys = [k(i) for i in ids]
        if op == "store":
            spec = m.prepare_store(keys)
            slot_of.update(zip(spec.keys, spec.slots))
            if storage and len(spec) and ids[0] % 2:
                m.storage_done(spec.keys)
        elif op == "load":
            spec = m.prepare_load(keys)
            slot_of.update(zip(spec.keys, spec.slots))
            pinned += spec.keys
        elif op == "release" and pinned:
            m.release([pinned.pop()])
        elif op in ("disk_ok", "disk_bad"):
            m.storage_done(keys if op == "disk_ok" else [], failed=keys if op == "disk_bad" else [])
        elif op == "invalidate":
            m.invalidate(keys, storage=bool(ids[0] % 2))
        hosts = {key: slot_of[key] for key in slot_of if m.residency(key) & Residency.HOST}
        assert len(set(hosts.values())) == len(hosts)
        assert len(hosts) + m.num_free_slots + m.num_parked_slots == slots
        assert not {s for v in m._parked.values() for s in v} & set(hosts.values())
        for key in pinned:
            assert m.pins(key) >= 1


def test_change_log_names_every_store_promotion_eviction_and_invalidation():
    from tiersync.store.offload import TierChange

    H, S = Residency.HOST, Residency.STORAGE
    m = OffloadManager(OffloadConfig(num_slots=2, storage=True, track_changes=True))
    m.prepare_store([k(1), k(2)])
    m.storage_done([k(1), k(2)])
    m.storage_done([k(1)])  # reported twice: no second change
    assert m.take_changes() == [
        TierChange(k(1), H, True),
        TierChange(k(2), H, True),
        TierChange(k(1), S, True),
        TierChange(k(2), S, True),
    ]
    assert m.take_changes() == []
    m.prepare_store([k(3)])  # evicts the coldest host copy (k(1)); its disk copy stays
    m.storage_done([k(3)])
    assert m.take_changes() == [TierChange(k(1), H, False), TierChange(k(3), H, True), TierChange(k(3), S, True)]
    load = m.prepare_load([k(1)])  # a disk hit promoted to host, evicting k(2)'s host copy
    assert load.from_storage == (True,)
    assert m.take_changes() == [TierChange(k(2), H, False), TierChange(k(1), H, True)]
    m.release(load.keys)
    m.invalidate([k(3)], storage=True)
    assert m.take_changes() == [TierChange(k(3), H, False), TierChange(k(3), S, False)]
    assert m.add_storage([k(3), k(1)]) == 1 and m.take_changes() == [TierChange(k(3), S, True)]


def test_change_log_is_off_by_default_and_validated():
    m = OffloadManager(OffloadConfig(num_slots=1))
    m.prepare_store([k(1), k(2)])
    m.prepare_store([k(3)])
    assert m.take_changes() == []
    with pytest.raises(UsageError) as ei:
        OffloadConfig(num_slots=1, track_changes="yes")
    assert ei.value.argument == "OffloadConfig.track_changes"
