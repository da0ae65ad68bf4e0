"""The README's Python blocks run as written (each in a fresh interpreter), so they cannot rot,
and running them leaves nothing behind: no /dev/shm segment but the warm-boot one the README
says stays (removed here with ``tiersync shm reclaim``), no file outside the test's TMPDIR.

Blocks that are not programs on their own are named in ``NOT_RUN`` with the reason and the test
that covers them instead; a new block must be either run here or named there.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")
SHM = "/dev/shm"
WARM_BOOT_SEGMENT = os.path.join(SHM, "tiersync-default-llama8b")
NOT_RUN = {  # first line of the block -> why, and where it is exercised
    "from vllm import LLM": "needs a model path (model=...); tests/integrations/test_vllm_connector.py",
    "from tiersync.net.registry import open_registry": "continues the store block with a registry and "
    "store nodes; tests/net/test_sweep.py",
}


def _blocks() -> list[str]:
    with open(README) as f:
        return re.findall(r"^```python\n(.*?)^```", f.read(), flags=re.S | re.M)


CONTINUES = {"from tiersync.tiers.shm import ShmConfig": "import numpy as np"}
"""A block that uses what an earlier block defined (first line -> that block's first line)
runs with that block in front: the warm-boot block continues the first one."""


def _programs() -> list[tuple[str, str]]:
    """(first line, source) of each runnable program."""
    blocks = {b.splitlines()[0]: b for b in reversed(_blocks())}  # the first block of each first line
    out = []
    for block in _blocks():
        head = block.splitlines()[0]
        if head not in NOT_RUN:
            out.append((head, blocks[CONTINUES[head]] + block if head in CONTINUES else block))
    return out


def _shm_files() -> set[str]:
    return {n for n in os.listdir(SHM) if n.startswith("tiersync-")} if os.path.isdir(SHM) else set()


def test_every_block_is_run_or_named():
    heads = [b.splitlines()[0] for b in _blocks()]
    assert len(heads) >= 5 and set(NOT_RUN) <= set(heads)
    assert len(_programs()) == len(heads) - len(NOT_RUN)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("head, source", _programs(), ids=[f"block{i}" for i, _ in enumerate(_programs())])
def test_readme_block_runs_as_written_and_leaves_nothing(head, source, tmp_path):
    if "ShmConfig" in source and os.path.exists(WARM_BOOT_SEGMENT):
        pytest.skip(f"{WARM_BOOT_SEGMENT} exists already (someone's warm-boot segment): not touched")
    before = _shm_files()
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", source], check=False, capture_output=True, text=True, timeout=500, env=env, cwd=tmp_path
    )
    left = _shm_files() - before
    try:
        assert proc.returncode == 0, proc.stderr[-3000:]
        expected = {os.path.basename(WARM_BOOT_SEGMENT)} if "ShmConfig" in source else set()
        assert left == expected, f"left in {SHM}: {sorted(left)}"
    finally:
        for name in left:
            subprocess.run(
                [sys.executable, "-m", "tiersync", "shm", "reclaim", os.path.join(SHM, name)],
                check=False,
                capture_output=True,
                timeout=60,
            )
    assert not _shm_files() - before
