"""Fuzzing the warm-boot shared-memory segment with hypothesis.

A real segment is written once by :class:`ShmSegment` (some blocks published, of full,
partial and zero length, one rewritten); every example writes a damaged copy of its bytes
(flips anywhere, header and manifest fields set or filled, ranges zeroed, truncation, junk
appended, header fields re-sealed with a valid checksum) back to the segment's path and
reattaches. Invariants:

1. ``ShmSegment.open`` never raises, and ``list_segments`` never raises either;
2. it attaches warm when the checksummed header and the file size are unchanged, and
   (unless the damage re-sealed the header checksum) only then; a cold start reformats the
   file to the right size and recovers nothing; ``list_segments`` reports a problem for
   every header that does not parse, with the reason the attach gave;
3. every recovered block is one that was published (block, key, length) and its bytes are
   exactly the published ones; every entry flagged valid is counted recovered, torn or
   malformed;
4. a block whose manifest entry and payload bytes are unchanged is recovered;
5. the segment stays usable: a block published after recovery (as the host does) gets a
   seq above every recovered one and the next attach recovers it, byte-exact, as the newest.

Every segment lives in a private directory under /dev/shm, removed at the end.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from _damage import damage
from tiersync.tiers import shm_format as fmt
from tiersync.tiers.shm import ColdStart, Geometry, ShmConfig, ShmSegment

FUZZ = settings(max_examples=800, deadline=None)
GEO = Geometry(num_blocks=8, block_nbytes=4096, layout_digest=bytes(range(16)))
MODEL = "fuzz-model@v1"
SAVES = ((0, 4096), (2, 1000), (3, 0), (5, 4096), (7, 17), (2, 4096))  # (block, nbytes); block 2 twice
HEADER_CHECKED = fmt._HEADER.size  # the header bytes its checksum covers
MANIFEST_END = fmt.HEADER_NBYTES + GEO.num_blocks * fmt.ENTRY_NBYTES
FILE_NBYTES = fmt.payload_offset(GEO.num_blocks) + GEO.num_blocks * GEO.block_nbytes
ENTRY_FIELDS = (0, 8, 16, 24, 28, 60)  # seq, nbytes, checksum, key length, key, valid


def cfg(directory: str) -> ShmConfig:
    return ShmConfig(key="fuzz", model_id=MODEL, directory=directory)


def block_data(block: int, seed: int, nbytes: int) -> bytes:
    return np.random.default_rng([block, seed]).bytes(nbytes)


class Pristine:
    """The segment file as written: ``raw`` bytes, ``published`` {block: (key, bytes)} of the last saves."""

    def __init__(self, directory: str) -> None:
        self.directory, self.published = directory, {}
        with ShmSegment.open(cfg(directory), GEO) as seg:
            for seed, (block, nbytes) in enumerate(SAVES):
                data = block_data(block, seed, nbytes)
                seg.invalidate([block])
                seg.payload[block * GEO.block_nbytes : block * GEO.block_nbytes + nbytes] = data
                key = f"key-{block}-{seed}".encode()
                seg.publish(block, key, nbytes)
                self.published[block] = (key, data)
        self.raw = Path(cfg(directory).path).read_bytes()

    def __repr__(self) -> str:  # what hypothesis prints with a failing example
        return f"Pristine({len(self.raw)} bytes, blocks {sorted(self.published)})"

    def entry_intact(self, raw: bytes, block: int) -> bool:
        """Whether ``block``'s manifest entry and published payload bytes are unchanged in ``raw``."""
        at = fmt.HEADER_NBYTES + block * fmt.ENTRY_NBYTES
        start = fmt.payload_offset(GEO.num_blocks) + block * GEO.block_nbytes
        n = len(self.published[block][1])
        return (
            raw[at : at + fmt.ENTRY_NBYTES] == self.raw[at : at + fmt.ENTRY_NBYTES]
            and raw[start : start + n] == self.raw[start : start + n]
        )


@pytest.fixture(scope="module")
def pristine():
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    d = tempfile.mkdtemp(prefix="tiersync-test-fuzz-", dir=base)
    try:
        yield Pristine(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


KINDS = ("flip", "zero", "fill", "truncate", "extend", "u64", "reseal")
MUTATION = st.tuples(
    st.sampled_from(KINDS),
    st.one_of(
        st.integers(0, HEADER_CHECKED),  # where: in the header,
        st.builds(
            lambda b, f: fmt.HEADER_NBYTES + b * fmt.ENTRY_NBYTES + f,  # an entry's field,
            st.integers(0, GEO.num_blocks - 1),
            st.sampled_from(ENTRY_FIELDS),
        ),
        st.integers(fmt.HEADER_NBYTES, MANIFEST_END),  # anywhere in the manifest,
        st.floats(0, 1, exclude_max=True),
    ),  # or a fraction of the file
    st.integers(1, 100),  # how many bytes
    st.integers(0, 2**64 - 1),  # a value: mask, byte, field
)


def mutate(buf: bytearray, kind: str, at: int | float, n: int, value: int) -> bytearray:
    """``buf`` damaged by one mutation at offset ``at`` (a float: that fraction of the file);
    ``reseal``: a u64 written, then the header's checksum made valid again."""
    buf, at, _ = damage(buf, "u64" if kind == "reseal" else kind, at, n, value)
    if kind == "reseal" and at + 8 <= len(buf) and len(buf) >= HEADER_CHECKED:  # a writer that knows the format
        body = bytearray(buf[:HEADER_CHECKED])
        body[16:24] = bytes(8)
        struct.pack_into("<Q", buf, 16, xxhash.xxh3_64_intdigest(bytes(body)))
    return buf


AFTER = (1, b"after", block_data(1, 99, 333))  # (block, key, bytes) published after each recovery


def attach(directory: str):
    """Attach, recover, then publish AFTER as a host would; returns (cold_start, recovered, stats,
    {block: bytes} of the recovered blocks, seq of the new block)."""
    with ShmSegment.open(cfg(directory), GEO) as seg:
        assert os.path.getsize(cfg(directory).path) == FILE_NBYTES  # cold: reformatted to its size
        found = seg.recover()
        data = {r.block: bytes(seg.payload[r.block * GEO.block_nbytes :][: r.nbytes]) for r in found}
        block, key, new = AFTER
        seg.invalidate([block])
        seg.payload[block * GEO.block_nbytes : block * GEO.block_nbytes + len(new)] = new
        seq = seg.publish(block, key, len(new))
        return seg.cold_start, found, seg.stats, data, seq


def check_recovered(pristine: Pristine, raw: bytes, found, data) -> None:
    for r in found:
        assert r.block in pristine.published, f"block {r.block} was never published"
        key, expected = pristine.published[r.block]
        assert (r.key, r.nbytes, data[r.block]) == (key, len(expected), expected), f"block {r.block} is wrong"
    recovered = {r.block for r in found}
    for block in pristine.published:
        if pristine.entry_intact(raw, block):
            assert block in recovered, f"intact block {block} was not recovered"


def check_after(directory: str, found, seq: int) -> None:
    """The block published after recovery is the newest one and the next attach recovers it intact."""
    assert seq > max((r.seq for r in found), default=0)
    cold, again, _, got, _ = attach(directory)
    block, key, new = AFTER
    assert cold is None and (again[-1].block, again[-1].key, got[block]) == (block, key, new)


@FUZZ
@given(st.lists(MUTATION, min_size=1, max_size=4))
def test_damaged_segment_never_recovers_a_wrong_block(pristine, mutations):
    raw = bytearray(pristine.raw)
    for m in mutations:
        raw = mutate(raw, *m)
    raw = bytes(raw)
    path = cfg(pristine.directory).path
    Path(path).write_bytes(raw)
    try:
        [info] = ShmSegment.list_segments(pristine.directory)
        same = len(raw) == len(pristine.raw) and raw[:HEADER_CHECKED] == pristine.raw[:HEADER_CHECKED]
        cold, found, stats, data, seq = attach(pristine.directory)
        resealed = any(kind == "reseal" for kind, *_ in mutations)  # may keep model and geometry
        assert cold is None if same else (cold is not None or resealed), cold
        assert info.problem is None or cold is not None
        if cold in (ColdStart.CORRUPT_HEADER, ColdStart.VERSION_MISMATCH):
            assert info.problem is cold
        if cold is not None:
            assert found == [] and stats.torn == stats.malformed == 0
        else:
            flagged = sum(
                raw[at + 60 : at + 64] != bytes(4) for at in range(fmt.HEADER_NBYTES, MANIFEST_END, fmt.ENTRY_NBYTES)
            )
            assert stats.recovered + stats.torn + stats.malformed == flagged
        check_recovered(pristine, raw if cold is None else b"", found, data)
        check_after(pristine.directory, found, seq)
    finally:
        os.unlink(path)


def test_the_undamaged_copy_recovers_every_block(pristine):
    """The harness itself: with no mutation every last save comes back, warm."""
    Path(cfg(pristine.directory).path).write_bytes(pristine.raw)
    try:
        cold, found, stats, data, _ = attach(pristine.directory)
        assert cold is None and stats.torn == stats.malformed == 0
        assert {r.block: (r.key, data[r.block]) for r in found} == pristine.published
    finally:
        os.unlink(cfg(pristine.directory).path)


@pytest.mark.parametrize("seq", [2**64 - 1, 2**64 - 2])
def test_a_rotted_seq_does_not_break_later_publishes(pristine, seq):
    """Regression (found by the fuzz: mutations=[('flip', 4096, 1, 0), ('u64', 4096, 1, 2**64 - 2)]).
    A valid-flagged entry whose seq rotted to the top of the u64 range is torn and dropped by
    recover, but the seq counter had already continued after it: the next publish (or the one
    after) raised ``struct.error`` packing a seq of 2**64. Now recover resets the counter."""
    raw = bytearray(pristine.raw)
    struct.pack_into("<Q", raw, fmt.HEADER_NBYTES, seq)  # block 0's entry
    Path(cfg(pristine.directory).path).write_bytes(raw)
    try:
        cold, found, stats, _, new_seq = attach(pristine.directory)
        assert cold is None and stats.torn == 1 and 0 not in {r.block for r in found}
        check_after(pristine.directory, found, new_seq)
    finally:
        os.unlink(cfg(pristine.directory).path)
