"""Shared helpers for the networking tests (loopback only)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from _samehost_source import _CHILD, NBYTES


@pytest.fixture(scope="module")
def source():
    """(pid, address) of a buffer of NBYTES seeded bytes in another process."""
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(NBYTES)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        yield child.pid, int(child.stdout.readline())
    finally:
        child.stdin.close()
        child.wait(30)
