"""Root of the test tree: pytest puts this directory on ``sys.path``, so the shared helpers
here (``_isolated``) import from every suite."""

from __future__ import annotations

import os

import pytest

_SHM = "/dev/shm"


def _ours_in_shm() -> set[str]:
    """tiersync's names in /dev/shm, and the ``psm_*`` shared memory vLLM's processes leave when killed."""
    if not os.path.isdir(_SHM):
        return set()
    return {n for n in os.listdir(_SHM) if n.startswith(("tiersync-", "psm_"))}


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config._shm_at_start = _ours_in_shm()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The suite leaves /dev/shm as it found it: a segment a test (or an engine it killed) left
    behind fails the run, naming it."""
    left = _ours_in_shm() - getattr(session.config, "_shm_at_start", set())
    if left and not hasattr(session.config, "workerinput"):
        print(f"\n/dev/shm: left behind by the test session: {sorted(left)}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
