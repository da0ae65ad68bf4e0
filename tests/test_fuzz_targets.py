"""The atheris targets in fuzz/ (run for hours by hand, see fuzz/README.md), kept from rotting.

Each target imports without atheris and its core, ``one_input(data)``, runs here over a few
hundred seeded random inputs: no invariant may fail, and the file targets must not allocate
more than a small bound. Each target's oracle is shown to be live: with the tier broken on
purpose (a checksum not checked, an error type not caught) the same kind of input fails.
Inputs that once found bugs are replayed.
"""

from __future__ import annotations

import importlib.util
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from tiersync.tiers import shm_format
from tiersync.tiers.shm import ShmSegment
from tiersync.tiers.storage_read import ReadPass, ReadStatus

FUZZ_DIR = Path(__file__).resolve().parents[1] / "fuzz"
TARGETS = ("storage_segment", "shm_segment", "wire_frames")
PEAK_LIMIT = 4 << 20  # the damaged files are tens of KiB


@pytest.fixture(scope="module")
def targets():
    """The target modules, imported from fuzz/ as the maintainer's run would (its dir on sys.path)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(FUZZ_DIR))
        mods = {}
        for name in TARGETS:
            spec = importlib.util.spec_from_file_location(f"fuzz_{name}", FUZZ_DIR / f"{name}.py")
            mods[name] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mods[name])
        mutate = mods["storage_segment"]._mutate
        yield mods, mutate
        mods["shm_segment"].cleanup()  # its private /dev/shm directory


@pytest.mark.parametrize("name", TARGETS)
def test_each_target_has_one_input_and_main_needs_atheris(targets, name, monkeypatch):
    mod = targets[0][name]
    assert callable(mod.one_input) and (FUZZ_DIR / "README.md").is_file()
    monkeypatch.setattr(mod, "atheris", None)
    with pytest.raises(SystemExit, match="pip install atheris"):
        mod.main()


@pytest.mark.parametrize("name", TARGETS)
def test_one_input_holds_over_seeded_random_inputs(targets, name):
    one_input = targets[0][name].one_input
    rng = np.random.default_rng(20240614)
    tracemalloc.start()
    try:
        for _ in range(300):
            one_input(rng.bytes(int(rng.integers(0, 400))))
        one_input(b"")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < PEAK_LIMIT, f"{name} allocated {peak} bytes"


def test_mutation_programs_round_trip(targets):
    mutate = targets[1]
    ops = [("flip", 1, 1, 5000, 7), ("u64", 0, 8, 4096, 2**64 - 1), ("swap", 3, 512, 12, 99)]
    assert mutate.decode(mutate.encode(ops)[1:]) == ops
    buf = mutate.apply(bytearray(b"abcdef"), "truncate", 1, 3, 0)
    assert buf == b"abc" and mutate.apply(bytearray(b"abc"), "fill", 2, 1, 0x41) == b"aAA"


def test_storage_oracle_catches_an_unchecked_payload(targets, monkeypatch):
    def accept_all(self, seg, run, got):
        for j in run:
            q, i, _ = seg.items[j]
            self.out[q][i] = ReadStatus.OK

    monkeypatch.setattr(ReadPass, "_check", accept_all)
    mods, mutate = targets
    with pytest.raises(AssertionError, match="wrong bytes"):
        mods["storage_segment"].one_input(mutate.encode([("flip", 0, 1, 4096 + 10, 0)]))


def test_shm_oracle_catches_an_unverified_entry(targets, monkeypatch):
    monkeypatch.setattr(ShmSegment, "_verify", lambda self, block, e: "recovered")
    mods, mutate = targets
    payload = shm_format.payload_offset(8)
    with pytest.raises(AssertionError, match="wrong block 0"):
        mods["shm_segment"].one_input(mutate.encode([("flip", 0, 1, payload + 10, 0)]))


def test_wire_oracle_lets_other_errors_escape(targets, monkeypatch):
    conn_cls = targets[0]["wire_frames"].Connection

    def broken(self):
        raise IndexError("parser bug")

    monkeypatch.setattr(conn_cls, "next_event", broken)
    with pytest.raises(IndexError):
        targets[0]["wire_frames"].one_input(b"\x00\x10" + b"TSYN" * 20)


@pytest.mark.parametrize(
    ("name", "ops"),
    [
        # a torn tombstone sidecar hid the tombstone of the block read CORRUPT after it
        ("storage_segment", [("flip", 1, 1, 4096, 0), ("truncate", 2, 1, 32, 0)]),
        # a valid-flagged entry's seq rotted to 2**64 - 1: the next publish overflowed
        ("shm_segment", [("u64", 0, 8, shm_format.HEADER_NBYTES, 2**64 - 1)]),
        ("shm_segment", [("u64", 0, 8, shm_format.HEADER_NBYTES, 2**64 - 2)]),
    ],
)
def test_inputs_that_once_failed(targets, name, ops):
    mods, mutate = targets
    mods[name].one_input(mutate.encode(ops))
