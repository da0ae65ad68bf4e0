"""Host block allocator (tiersync.tiers.allocator), unit tests and a model-based property test."""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiersync.errors import CapacityError, UsageError
from tiersync.tiers.allocator import BlockAllocator, BlockState
from tiersync.tiers.eviction import LRUPolicy, S3FIFOPolicy

F, L, C = BlockState.FREE, BlockState.LOCKED, BlockState.CACHED


def counts(a: BlockAllocator) -> tuple[int, int, int]:
    return a.num_free, a.num_locked, a.num_cached


def test_allocate_free_first_in_ascending_order_then_evicts_lru():
    evicted = []
    a = BlockAllocator(6, on_evict=evicted.append)
    assert a.allocate(4) == [0, 1, 2, 3]
    assert all(a.state(b) is L and a.lock_count(b) == 1 for b in range(4))
    a.unlock([2, 0, 3])
    assert counts(a) == (2, 1, 3)
    a.touch([0])  # 0 is now the most recently used
    got = a.allocate(4)  # 2 free (4, 5), then evict the two LRU cached: 2, 3
    assert got == [4, 5, 2, 3] and evicted == [[2, 3]]
    assert counts(a) == (0, 5, 1) and a.state(0) is C


def test_capacity_error_reports_and_changes_nothing():
    evicted = []
    a = BlockAllocator(5, on_evict=evicted.append)
    a.allocate(3)
    a.unlock([1])
    with pytest.raises(CapacityError) as ei:
        a.allocate(4)
    e = ei.value
    assert (e.requested, e.used, e.free) == (4, 2, 3)
    assert e.context == {"requested": 4, "used": 2, "free": 3}
    assert counts(a) == (2, 2, 1) and evicted == [] and a.state(1) is C


def test_locked_blocks_are_never_evicted():
    a = BlockAllocator(4)
    a.allocate(4)
    a.unlock([0, 1])
    a.lock([0])  # cached -> locked again
    assert a.state(0) is L and a.lock_count(0) == 1
    assert a.allocate(1) == [1]
    with pytest.raises(CapacityError):
        a.allocate(1)


def test_lock_counts_nest():
    a = BlockAllocator(3)
    a.allocate(1)
    a.lock([0, 0])
    assert a.lock_count(0) == 3
    a.unlock([0])
    assert a.state(0) is L and a.lock_count(0) == 2
    with pytest.raises(UsageError):
        a.free([0])  # someone else still holds it
    a.unlock([0, 0])
    assert a.state(0) is C and a.lock_count(0) == 0
    a.free([0])
    assert a.state(0) is F and counts(a) == (3, 0, 0)


def test_adopt_cached():
    a = BlockAllocator(4)
    a.adopt_cached([2, 0])
    assert counts(a) == (2, 0, 2) and a.allocate(4) == [1, 3, 2, 0]
    with pytest.raises(UsageError):
        a.adopt_cached([1])


@pytest.mark.parametrize(
    "call, argument",
    [
        (lambda a: a.allocate(0), "n"),
        (lambda a: a.allocate(-2), "n"),
        (lambda a: a.allocate(1.0), "n"),
        (lambda a: a.allocate(True), "n"),
        (lambda a: a.lock([4]), "blocks"),
        (lambda a: a.lock([-1]), "blocks"),
        (lambda a: a.lock([1.5]), "blocks"),
        (lambda a: a.lock(["1"]), "blocks"),
        (lambda a: a.lock([3]), "blocks"),  # 3 is free
        (lambda a: a.unlock([0, 0]), "blocks"),
        (lambda a: a.unlock([2]), "blocks"),  # 2 cached
        (lambda a: a.unlock([3]), "blocks"),
        (lambda a: a.unlock([0.0]), "blocks"),
        (lambda a: a.free([3]), "blocks"),
        (lambda a: a.free([0, 0]), "blocks"),
        (lambda a: a.free([9]), "blocks"),
        (lambda a: a.free([1]), "blocks"),  # locked twice
        (lambda a: a.state(4), "block"),
        (lambda a: a.lock_count(-1), "block"),
        (lambda a: a.all_locked([-1]), "blocks"),
        (lambda a: a.all_locked([4]), "blocks"),
    ],
)
def test_bad_calls_are_refused_naming_the_argument_and_change_nothing(call, argument):
    a = BlockAllocator(4)
    a.allocate(3)  # 0, 1, 2 locked; 3 free
    a.lock([1])  # 1 locked twice
    a.unlock([2])  # 2 cached
    before = (counts(a), [a.lock_count(b) for b in range(4)], [a.state(b) for b in range(4)])
    with pytest.raises(UsageError) as ei:
        call(a)
    assert ei.value.argument == argument
    assert (counts(a), [a.lock_count(b) for b in range(4)], [a.state(b) for b in range(4)]) == before


def test_constructor_and_all_locked():
    for bad in (0, -1, 2.5, "4"):
        with pytest.raises(UsageError) as ei:
            BlockAllocator(bad)
        assert ei.value.argument == "num_blocks"
    a = BlockAllocator(3)
    a.allocate(2)
    assert a.all_locked([0, 1]) and a.all_locked([]) and not a.all_locked([0, 2])
    assert a.all_locked(np.array([1, 0]))


def test_threads_allocating_and_freeing_keep_counts_consistent():
    a = BlockAllocator(64)
    errors = []

    def worker() -> None:
        try:
            for i in range(200):
                try:
                    got = a.allocate(1 + i % 5)
                except CapacityError:
                    continue
                a.unlock(got[: len(got) // 2])
                a.free(got[len(got) // 2 :])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    ts = [threading.Thread(target=worker) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert errors == []
    assert a.num_locked == 0 and a.num_free + a.num_cached == 64


# -- model-based property test -------------------------------------------------
class Model:
    """Reference: states, lock counts, the free stack and (for LRU) the exact eviction order."""

    def __init__(self, n: int, exact_order: bool) -> None:
        self.n, self.exact = n, exact_order
        self.state = dict.fromkeys(range(n), F)
        self.locks = dict.fromkeys(range(n), 0)
        self.free_stack = list(range(n - 1, -1, -1))
        self.lru: list[int] = []  # cached blocks, least recently used first

    def cached(self) -> set[int]:
        return {b for b, s in self.state.items() if s is C}

    def allocate(self, k: int, got: list[int] | None, evicted: list[list[int]]) -> None:
        need = k - len(self.free_stack)
        if need > len(self.lru):
            assert got is None and evicted == []  # all-or-nothing
            return
        assert got is not None and len(got) == k and len(set(got)) == k
        take = min(k, len(self.free_stack))
        from_free = [self.free_stack.pop() for _ in range(take)]
        victims = got[take:]
        assert got[:take] == from_free
        assert evicted == ([victims] if need > 0 else [])  # on_evict names exactly the victims
        assert set(victims) <= self.cached()  # never a locked or free block
        if self.exact:
            assert victims == self.lru[: max(need, 0)]  # the least recently used ones
        for b in victims:
            self.lru.remove(b)
        for b in got:
            self.state[b], self.locks[b] = L, 1

    def lock(self, ids: list[int]) -> bool:
        if any(self.state[b] is F for b in ids):
            return False
        for b, c in Counter(ids).items():
            if self.state[b] is C:
                self.lru.remove(b)
            self.state[b], self.locks[b] = L, self.locks[b] + c
        return True

    def unlock(self, ids: list[int]) -> bool:
        cnt = Counter(ids)
        if any(self.locks[b] < c for b, c in cnt.items()):
            return False
        for b in sorted(cnt):
            self.locks[b] -= cnt[b]
            if self.locks[b] == 0:
                self.state[b] = C
                self.lru.append(b)
        return True

    def free(self, ids: list[int]) -> bool:
        if len(set(ids)) != len(ids) or any(
            self.state[b] is F or (self.state[b] is L and self.locks[b] > 1) for b in ids
        ):
            return False
        for b in ids:
            if self.state[b] is C:
                self.lru.remove(b)
            self.free_stack.append(b)
            self.state[b], self.locks[b] = F, 0
        return True

    def touch(self, ids: list[int]) -> None:
        for b in ids:
            if self.state[b] is C:
                self.lru.remove(b)
                self.lru.append(b)


def check(a: BlockAllocator, m: Model) -> None:
    assert [a.state(b) for b in range(m.n)] == [m.state[b] for b in range(m.n)]
    assert [a.lock_count(b) for b in range(m.n)] == [m.locks[b] for b in range(m.n)]
    by = Counter(m.state.values())
    assert counts(a) == (by[F], by[L], by[C]) and sum(counts(a)) == m.n
    assert sorted(a._free) == sorted(b for b in range(m.n) if m.state[b] is F)  # in exactly one place
    assert all((b in a._policy) == (m.state[b] is C) for b in range(m.n))
    assert all((m.locks[b] > 0) == (m.state[b] is L) for b in range(m.n))


@pytest.mark.parametrize("policy", [LRUPolicy, S3FIFOPolicy])
@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 10), data=st.data())
def test_allocator_matches_reference_model(policy, n, data):
    evicted: list[list[int]] = []
    a = BlockAllocator(n, policy=policy(), on_evict=evicted.append)
    m = Model(n, exact_order=policy is LRUPolicy)
    for _ in range(data.draw(st.integers(1, 30), label="steps")):
        op = data.draw(st.sampled_from(["allocate", "lock", "unlock", "free", "touch"]), label="op")
        if op == "allocate":
            k = data.draw(st.integers(1, n + 2), label="k")
            evicted.clear()
            try:
                got = a.allocate(k)
            except CapacityError:
                got = None
            m.allocate(k, got, evicted)
            check(a, m)
            continue
        pick = data.draw(st.sampled_from(["any", "locked", "cached"]), label="pick")
        pool = {
            "any": list(range(n)),
            "locked": [b for b in range(n) if m.state[b] is L],
            "cached": sorted(m.cached()),
        }[pick] or list(range(n))
        ids = data.draw(st.lists(st.sampled_from(pool), max_size=4), label="ids")
        if op == "touch":
            a.touch(ids)
            m.touch(ids)
        else:
            try:
                getattr(a, op)(ids)
                ok = True
            except UsageError:
                ok = False
            assert getattr(m, op)(ids) == ok, (op, ids)
        check(a, m)
