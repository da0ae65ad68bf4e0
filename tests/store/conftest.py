"""Fixtures of the store tests (helpers live in _store_helpers)."""

from __future__ import annotations

import pytest

from _store_helpers import make_layout
from tiersync.store import KVCacheStore, StoreConfig


@pytest.fixture
def dev_layout():
    return make_layout()


@pytest.fixture
def store(dev_layout):
    _dev, layout = dev_layout
    s = KVCacheStore(layout, StoreConfig(host_blocks=8))
    yield s
    s.close()
