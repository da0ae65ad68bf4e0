"""SIGKILL during storage writes, repeatedly: acknowledged blocks survive, nothing wrong is served."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from _storage_helpers import IDENT, block_bytes
from tiersync.tiers import storage_format as fmt
from tiersync.tiers.storage import ReadStatus, StorageConfig, StorageTier

CHILD = os.path.join(os.path.dirname(__file__), "_storage_child.py")
KILLS = 20


def spawn(*args):
    return subprocess.Popen(
        [sys.executable, CHILD, *args], stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True, bufsize=1
    )


def parse_ack(line: str) -> dict[bytes, int]:
    return {bytes.fromhex(i.split(":")[0]): int(i.split(":")[1]) for i in line.split()[1:]}


def check_all(directory: str, acked: dict[bytes, int]) -> int:
    """Every acked block is there and exact; every block served at all is exact."""
    with StorageTier(StorageConfig(directory, IDENT, workers=2)) as t:
        known = set(t.keys())
        assert set(acked) <= known, f"lost {len(set(acked) - known)} acknowledged blocks"
        sizes = {k: t._locs[k].record.length for k in known}
        for k, nb in sizes.items():
            buf = bytearray(nb)
            st = t.read([k], [memoryview(buf)]).result()[0]
            assert st is ReadStatus.OK and bytes(buf) == block_bytes(k, nb), k.hex()
            if k in acked:
                assert nb == acked[k]
        return len(known)


@pytest.mark.slow
def test_sigkill_during_writes_never_loses_acked_or_serves_wrong_bytes():
    directory = tempfile.mkdtemp(prefix="tiersync-crash-")
    rng = random.Random(1234)
    acked: dict[bytes, int] = {}
    try:
        for run in range(KILLS):
            child = spawn("write", directory, f"run{run}")
            assert child.stdout.readline().strip() == "READY"
            for _ in range(rng.randint(0, 3)):  # kill after 0..3 acks, i.e. in the middle of a write
                line = child.stdout.readline()
                assert line.startswith("ACK"), line
                acked.update(parse_ack(line))
            time.sleep(rng.random() * 0.004)  # a random moment inside the next write (not polling)
            child.send_signal(signal.SIGKILL)
            rest = child.stdout.read()  # acks printed before the kill landed count too
            for line in rest.splitlines():
                if line.startswith("ACK"):
                    acked.update(parse_ack(line))
            child.wait()
            assert child.returncode == -signal.SIGKILL
            if run % 6 == 5:
                check_all(directory, acked)
        assert check_all(directory, acked) >= len(acked) > 0
        # temp files of the killed writers are cleaned up by the next open on this host
        assert not [n for n in os.listdir(directory) if n.startswith(fmt.TMP_PREFIX)]
    finally:
        shutil.rmtree(directory, ignore_errors=True)
