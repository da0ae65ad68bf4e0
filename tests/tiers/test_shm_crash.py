"""SIGKILL a process that is saving blocks into a shm segment; every acked save must survive.

A child attaches, saves blocks in a loop whose n-th save is a pure function of ``base + n``
(block, nbytes, key and bytes), and prints ``ACK block round seq`` after each publish. The
parent kills it at random moments (after a random number of ACKs plus 0-2 ms, so often
mid-save), re-attaches and checks each block against the only outcomes that are possible.
Every third child is "careless": it rewrites blocks without ``invalidate`` first, so a kill
mid-write leaves a valid flag over changed bytes, which the checksum must reject.
"""

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

from tiersync.errors import UsageError
from tiersync.tiers.shm import ColdStart, Geometry, ShmConfig, ShmSegment

PLAN_SRC = '''
import random

def plan(rnd, num_blocks, block_nbytes):
    """The save number ``rnd``: (block, nbytes, key, bytes), from the round and block id only."""
    block = random.Random(rnd).randrange(num_blocks)
    nbytes = block_nbytes - (rnd % 8) * 512
    chunk = random.Random((block << 40) | rnd).randbytes(4096)  # cheap, so kills land mid-save
    data = (chunk * (nbytes // 4096 + 1))[:nbytes]
    return block, nbytes, b"b%d-r%d" % (block, rnd), data
'''

CHILD_SRC = (
    PLAN_SRC
    + """
import sys
from tiersync.tiers.shm import Geometry, ShmConfig, ShmSegment

directory, model_id, nb, bn, base, careless = sys.argv[1:]
nb, bn, base, careless = int(nb), int(bn), int(base), careless == "1"
seg = ShmSegment.open(ShmConfig(key="crash", model_id=model_id, directory=directory),
                      Geometry(nb, bn, bytes(range(16))))
sys.stdout.write("READY %s\\n" % (seg.cold_start.name if seg.cold_start else "WARM"))
sys.stdout.flush()
rnd = base
while True:
    block, nbytes, key, data = plan(rnd, nb, bn)
    if not careless:
        seg.invalidate([block])
    seg.payload[block * bn : block * bn + nbytes] = data
    seq = seg.publish(block, key, nbytes)
    sys.stdout.write("ACK %d %d %d\\n" % (block, rnd, seq))
    sys.stdout.flush()
    rnd += 1
"""
)

_ns: dict = {}
exec(PLAN_SRC, _ns)
plan = _ns["plan"]

MODEL = "crash-model@v1"
NUM_BLOCKS, BLOCK_NBYTES = 8, 256 * 1024
GEO = Geometry(NUM_BLOCKS, BLOCK_NBYTES, bytes(range(16)))
KILLS = 32


@pytest.fixture
def shm_dir():
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    path = tempfile.mkdtemp(prefix="tiersync-crash-", dir=base)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def config(directory: str, model_id: str = MODEL) -> ShmConfig:
    return ShmConfig(key="crash", model_id=model_id, directory=directory)


def spawn(directory: str, base: int, careless: bool) -> subprocess.Popen:
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.abspath(src), os.environ.get("PYTHONPATH", "")])}
    args = [
        sys.executable,
        "-c",
        CHILD_SRC,
        directory,
        MODEL,
        str(NUM_BLOCKS),
        str(BLOCK_NBYTES),
        str(base),
        "1" if careless else "0",
    ]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def read_ready(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline()
    if not line.startswith("READY "):
        proc.kill()
        pytest.fail(f"child did not start: {line!r} {proc.communicate()[1]}")
    return line.split()[1]


def parse_acks(lines: list[str]) -> list[tuple[int, int, int]]:
    """(block, round, seq) of every complete ACK line."""
    acks = []
    for line in lines:
        if line.endswith("\n") and line.startswith("ACK "):
            block, rnd, seq = map(int, line.split()[1:])
            acks.append((block, rnd, seq))
    return acks


def run_and_kill(proc: subprocess.Popen, rng: random.Random) -> list[tuple[int, int, int]]:
    """Let the child ack a random number of saves, wait 0-2 ms, SIGKILL it; return all its ACKs."""
    lines = [proc.stdout.readline() for _ in range(rng.randrange(0, 16))]
    time.sleep(rng.uniform(0, 0.002))
    proc.send_signal(signal.SIGKILL)
    rest = proc.stdout.read()  # not communicate(): it would skip lines already buffered
    err = proc.stderr.read()
    assert proc.wait() == -signal.SIGKILL, err
    proc.stdout.close()
    proc.stderr.close()
    return parse_acks(lines + rest.splitlines(keepends=True))


def matches(seg: ShmSegment, rec, rnd: int) -> bool:
    block, nbytes, key, data = plan(rnd, NUM_BLOCKS, BLOCK_NBYTES)
    start = rec.block * BLOCK_NBYTES
    return (block, key, nbytes) == (rec.block, rec.key, rec.nbytes) and bytes(
        seg.payload[start : start + nbytes]
    ) == data


def check_recovery(directory, state, acked_seq, in_flight, outcomes) -> None:
    """Re-attach; each block must hold ``state[b]`` (the last known save), except the block of
    the unacked ``in_flight`` save, which may also be absent or hold that save. Updates state."""
    fb = plan(in_flight, NUM_BLOCKS, BLOCK_NBYTES)[0]
    with ShmSegment.open(config(directory), GEO) as seg:
        assert seg.cold_start is None
        recovered = seg.recover()
        assert [r.seq for r in recovered] == sorted(r.seq for r in recovered)
        by_block = {r.block: r for r in recovered}
        for block in range(NUM_BLOCKS):
            allowed = {state[block]} | ({None, in_flight} if block == fb else set())
            rec = by_block.get(block)
            got = None if rec is None else next((r for r in allowed if r is not None and matches(seg, rec, r)), "bad")
            assert got in allowed, f"block {block}: recovered {rec}, allowed rounds {allowed}"
            if got is not None and got in acked_seq:
                assert rec.seq == acked_seq[got]
            if block == fb:
                outcomes["absent" if got is None else "new" if got == in_flight else "old"] += 1
            state[block] = got
        outcomes["torn"] += seg.stats.torn


def test_sigkill_mid_save_recovers_every_acked_block(shm_dir):
    rng = random.Random(int(os.environ.get("TIERSYNC_CRASH_SEED", "20240611")))
    state: dict[int, int | None] = dict.fromkeys(range(NUM_BLOCKS))
    outcomes = dict.fromkeys(["absent", "old", "new", "torn"], 0)
    acked_total = 0
    t0 = time.monotonic()
    for i in range(KILLS):
        base = (i + 1) * 1_000_000
        proc = spawn(shm_dir, base, careless=i % 3 == 2)
        assert read_ready(proc) == ("NEW" if i == 0 else "WARM")
        acks = run_and_kill(proc, rng)
        acked_total += len(acks)
        assert [a[1] for a in acks] == list(range(base, base + len(acks)))
        for block, rnd, _ in acks:
            state[block] = rnd
        check_recovery(shm_dir, state, {a[1]: a[2] for a in acks}, base + len(acks), outcomes)
    assert acked_total > 0
    print(f"\n{KILLS} kills in {time.monotonic() - t0:.1f} s, {acked_total} acked saves, in-flight {outcomes}")
    with ShmSegment.open(config(shm_dir, "another-model@v1"), GEO) as seg:
        assert seg.cold_start is ColdStart.MODEL_MISMATCH and seg.recover() == []
    with ShmSegment.open(config(shm_dir), GEO) as seg:
        assert seg.cold_start is ColdStart.MODEL_MISMATCH and seg.recover() == []


def test_live_child_holds_lock_until_killed(shm_dir):
    proc = spawn(shm_dir, base=1, careless=False)
    assert read_ready(proc) == "NEW"
    proc.stdout.readline()
    with pytest.raises(UsageError, match="attached by another live process"):
        ShmSegment.open(config(shm_dir), GEO)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()  # lines are not needed here
    with ShmSegment.open(config(shm_dir), GEO) as seg:
        assert seg.cold_start is None and len(seg.recover()) >= 1
