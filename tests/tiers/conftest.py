from __future__ import annotations

import shutil
import tempfile

import pytest


@pytest.fixture
def sdir():
    """A fresh directory for a storage tier, removed afterwards."""
    d = tempfile.mkdtemp(prefix="tiersync-storage-")
    yield d
    shutil.rmtree(d, ignore_errors=True)
