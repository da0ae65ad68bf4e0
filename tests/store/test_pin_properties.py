"""Property tests: the store's pin / LRU algebra against a small reference model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _store_helpers import keys_for, make_layout
from tiersync.errors import CapacityError, UsageError
from tiersync.store import KVCacheStore, Residency, StoreConfig

CAP = 4
POOL = keys_for(10, seed=3)


def pattern(key: bytes, nbytes: int) -> np.ndarray:
    return np.frombuffer((key * (nbytes // len(key) + 1))[:nbytes], dtype=np.uint8)


class Model:
    """Host-only reference: pins per key; ``order`` = recency of becoming evictable."""

    def __init__(self) -> None:
        self.pins: dict[bytes, int] = {}
        self.order: list[bytes] = []

    def bump(self, k: bytes) -> None:
        self.order.remove(k)
        self.order.append(k)

    def save(self, keys):
        new, skipped = [], []
        for k in keys:
            (skipped if k in self.pins or k in new else new).append(k)
        if not new:
            return (), tuple(skipped)
        evictable = [k for k in self.order if self.pins[k] == 0]
        need = len(new) - (CAP - len(self.order))
        if need > len(evictable):
            raise CapacityError("model full")
        for k in evictable[: max(need, 0)]:
            self.order.remove(k)
            del self.pins[k]
        for k in new:
            self.pins[k] = 0
            self.order.append(k)
        return tuple(new), tuple(skipped)

    def lookup(self, keys):
        hits = []
        for k in keys:
            if k not in self.pins:
                break
            hits.append(k)
        for k in hits:
            self.pins[k] += 1
        return tuple(hits)

    def release(self, keys):
        need: dict[bytes, int] = {}
        for k in keys:
            need[k] = need.get(k, 0) + 1
        if any(self.pins.get(k, 0) < n for k, n in need.items()):
            raise UsageError("not pinned")
        for k, n in need.items():
            self.pins[k] -= n
            if self.pins[k] == 0:
                self.bump(k)


key_lists = st.lists(st.sampled_from(POOL), min_size=1, max_size=5)
ops = st.lists(st.tuples(st.sampled_from(["save", "lookup", "release", "load"]), key_lists), max_size=25)


def run_op(store, model, dev, op, keys, outcome):
    if op == "save":
        for i, k in enumerate(keys):
            dev[i] = pattern(k, dev.shape[1])
        try:
            expect = model.save(keys)
        except CapacityError:
            with pytest.raises(CapacityError):
                store.save(range(len(keys)), keys)
            return
        got = store.save(range(len(keys)), keys).result(10)
        assert (got.saved, got.skipped) == expect
    elif op == "lookup":
        assert store.lookup(keys).keys == model.lookup(keys)
    else:  # release / load share the pin check; a load also moves bytes
        try:
            model.release(keys)
        except UsageError:
            with pytest.raises(UsageError):
                (store.release(keys) if op == "release" else store.load(keys, range(len(keys))))
            return
        if op == "release":
            store.release(keys)
        else:
            dev[: len(keys)] = 0
            store.load(keys, range(len(keys))).result(10)
            for i, k in enumerate(keys):
                assert (dev[i] == pattern(k, dev.shape[1])).all()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_lru_pin_algebra_matches_model(script):
    dev, layout = make_layout(num_blocks=8, nbytes=128)
    with KVCacheStore(layout, StoreConfig(host_blocks=CAP)) as store:
        model = Model()
        for op, keys in script:
            run_op(store, model, dev, op, keys, None)
            for k in POOL:
                assert store.pins(k) == model.pins.get(k, 0)
                assert (store.residency([k])[0] == Residency.HOST) == (k in model.pins)
        stats = store.stats()
        assert stats.host_entries == len(model.order) and stats.host_free_blocks == CAP - len(model.order)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_s3fifo_never_evicts_pinned_and_keeps_pins_exact(script):
    _dev, layout = make_layout(num_blocks=8, nbytes=128)
    with KVCacheStore(layout, StoreConfig(host_blocks=CAP, policy="s3fifo")) as store:
        pins: dict[bytes, int] = {}
        for op, keys in script:
            if op == "save":
                try:
                    store.save(range(len(keys)), keys).result(10)
                except CapacityError:
                    assert store.stats().host_evictable < len(set(keys))
            elif op == "lookup":
                for k in store.lookup(keys).keys:
                    pins[k] = pins.get(k, 0) + 1
            else:
                counts = {k: keys.count(k) for k in keys}
                ok = all(pins.get(k, 0) >= n for k, n in counts.items())
                fn = store.release if op == "release" else (lambda ks: store.load(ks, range(len(ks))).result(10))
                if not ok:
                    with pytest.raises(UsageError):
                        fn(keys)
                    continue
                fn(keys)
                for k, n in counts.items():
                    pins[k] -= n
            for k, n in pins.items():
                assert store.pins(k) == n
                if n:
                    assert store.residency([k])[0] & Residency.HOST  # pinned: never evicted
