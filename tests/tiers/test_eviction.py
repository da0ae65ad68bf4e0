"""Eviction policies (tiersync.tiers.eviction): LRU and S3-FIFO."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiersync.tiers.eviction import LRUPolicy, S3FIFOPolicy

POLICIES = [LRUPolicy, S3FIFOPolicy]


def test_lru_orders_by_last_use():
    p = LRUPolicy()
    for k in "abcde":
        p.add(k)
    p.touch("a")
    p.touch("c")
    p.touch("zz")  # unknown: ignored
    assert p.choose(5) == ["b", "d", "e", "a", "c"]
    assert p.choose(2) == ["b", "d"]
    p.remove("b")
    p.remove("nope")
    assert p.choose(1) == ["d"] and len(p) == 4 and "b" not in p and "a" in p
    p.add("d")  # re-adding counts as a use
    assert p.choose(4) == ["e", "a", "c", "d"]


@pytest.mark.parametrize("cls", POLICIES)
def test_choose_too_many_returns_none_and_changes_nothing(cls):
    p = cls()
    for k in range(5):
        p.add(k)
    p.touch(2)
    first = p.choose(5)
    assert p.choose(6) is None
    assert p.choose(5) == first and len(p) == 5  # choose is a dry run: same answer twice
    assert cls().choose(1) is None and cls().choose(0) == []


@pytest.mark.parametrize("cls", POLICIES)
def test_remove_and_contains(cls):
    p = cls()
    for k in range(4):
        p.add(k)
    p.remove(1)
    p.remove(99)
    assert len(p) == 3 and 1 not in p and 0 in p
    assert sorted(p.choose(3)) == [0, 2, 3]


def test_s3fifo_evicts_one_hit_wonders_before_touched_keys():
    p = S3FIFOPolicy()
    for k in "abcd":
        p.add(k)
    p.touch("b")
    assert p.choose(3) == ["a", "c", "d"]
    assert p.choose(4) == ["a", "c", "d", "b"]


def test_s3fifo_is_scan_resistant_where_lru_is_not():
    hot = list(range(4))
    scan = list(range(100, 120))
    results = {}
    for cls in POLICIES:
        p = cls()
        for k in hot:
            p.add(k)
        for k in hot:
            p.touch(k)  # the working set is used again
        for k in scan:
            p.add(k)  # a one-pass scan arrives after it
        results[cls] = set(p.choose(len(scan)))
    assert results[S3FIFOPolicy] == set(scan)  # the scan goes, the hot set stays
    assert results[LRUPolicy] & set(hot) == set(hot)  # LRU throws the hot set out first


@pytest.mark.parametrize("cls", POLICIES)
@settings(max_examples=100, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "touch", "remove", "choose"]), st.integers(0, 9)), max_size=60))
def test_policy_tracks_exactly_its_keys_and_choose_names_n_members(cls, ops):
    p, model = cls(), set()
    for op, k in ops:
        if op == "add":
            p.add(k)
            model.add(k)
        elif op == "touch":
            p.touch(k)
        elif op == "remove":
            p.remove(k)
            model.discard(k)
        else:
            n = k % (len(model) + 2)
            got = p.choose(n)
            if n > len(model):
                assert got is None
            else:
                assert len(got) == n and len(set(got)) == n and set(got) <= model
        assert len(p) == len(model)
        assert all((key in p) == (key in model) for key in range(10))
