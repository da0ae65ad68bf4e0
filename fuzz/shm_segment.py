"""atheris target: a warm-boot shared-memory segment whose header, manifest or payload is damaged.

Run: ``python fuzz/shm_segment.py -max_total_time=3600`` (see fuzz/README.md). The core is
:func:`one_input`, which tests/test_fuzz_targets.py also runs without atheris.

Input: see :mod:`_mutate` (mode byte, then a mutation program applied to a segment the
real ShmSegment wrote, or the raw segment file). Invariants: ``ShmSegment.open`` and
``list_segments`` never raise; an unchanged header and size attach warm, a cold start
recovers nothing; every recovered block was published, with exactly its bytes; an entry
whose fields and payload are unchanged is recovered; a block published after recovery gets
a newer seq and the next attach recovers it intact. The segment lives in a private
directory (under /dev/shm when writable), removed by :func:`cleanup`, at exit, or (after
a libFuzzer run, which skips atexit) by the next run's :func:`remove_stale`.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

try:
    import atheris
except ImportError:  # the tests run one_input without it
    atheris = None

import _mutate  # fuzz/_mutate.py: the script's directory is on sys.path
from tiersync.tiers import shm_format as fmt
from tiersync.tiers.shm import Geometry, ShmConfig, ShmSegment

GEO = Geometry(num_blocks=8, block_nbytes=4096, layout_digest=bytes(range(16)))
SAVES = ((0, 4096), (2, 1000), (3, 0), (5, 4096), (7, 17), (2, 4096))  # (block, nbytes); block 2 twice
HEADER_CHECKED = fmt._HEADER.size  # the header bytes its checksum covers
FILE_NBYTES = fmt.payload_offset(GEO.num_blocks) + GEO.num_blocks * GEO.block_nbytes
AFTER = (1, b"after", np.random.default_rng(99).bytes(333))  # published after each recovery
BASE = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None  # None: the temp directory
PREFIX = "tiersync-fuzz-shm-"  # then the pid of the run
_state: dict = {}


def data_of(block: int, seed: int, nbytes: int) -> bytes:
    return np.random.default_rng([block, seed]).bytes(nbytes)


def config(key: str = "fuzz") -> ShmConfig:
    """The segment's config, in a private directory made on first use."""
    if "dir" not in _state:
        _state["dir"] = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=BASE)
        atexit.register(cleanup)
    return ShmConfig(key=key, model_id="fuzz-model@v1", directory=_state["dir"])


def cleanup() -> None:
    """Remove the private directory (and the segment in it)."""
    d = _state.pop("dir", None)
    if d:
        shutil.rmtree(d, ignore_errors=True)


def remove_stale() -> None:
    """Remove the directories of runs that are gone: libFuzzer ends a run with exit(), which
    skips Python's atexit, so each run cleans up after the ones before it."""
    for name in os.listdir(BASE or tempfile.gettempdir()):
        pid = name[len(PREFIX) :].split("-")[0]
        if name.startswith(PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(os.path.join(BASE or tempfile.gettempdir(), name), ignore_errors=True)


def pristine() -> tuple[bytes, dict[int, tuple[bytes, bytes]]]:
    """(the segment's bytes, {block: (key, bytes)} of the last save of each block), built once."""
    if "raw" not in _state:
        published = {}
        with ShmSegment.open(config("pristine"), GEO) as seg:
            for seed, (block, nbytes) in enumerate(SAVES):
                seg.invalidate([block])
                seg.payload[block * GEO.block_nbytes :][:nbytes] = data = data_of(block, seed, nbytes)
                seg.publish(block, b"key-%d-%d" % (block, seed), nbytes)
                published[block] = (b"key-%d-%d" % (block, seed), data)
        _state["raw"], _state["published"] = Path(config("pristine").path).read_bytes(), published
        os.unlink(config("pristine").path)
    return _state["raw"], _state["published"]


def damaged(data: bytes) -> bytes:
    if data[:1] and data[0] % 2:
        return data[1:]
    buf = bytearray(pristine()[0])
    for kind, _, n, offset, value in _mutate.decode(data[1:]):
        buf = _mutate.apply(buf, kind, n, offset, value)
    return bytes(buf)


def attach():
    """Attach, recover, publish AFTER; returns (cold_start, recovered, stats, {block: bytes}, new seq)."""
    with ShmSegment.open(config(), GEO) as seg:
        assert os.path.getsize(config().path) == FILE_NBYTES, "not (re)formatted to its size"
        found = seg.recover()
        got = {r.block: bytes(seg.payload[r.block * GEO.block_nbytes :][: r.nbytes]) for r in found}
        block, key, new = AFTER
        seg.invalidate([block])
        seg.payload[block * GEO.block_nbytes :][: len(new)] = new
        return seg.cold_start, found, seg.stats, got, seg.publish(block, key, len(new))


def _entry(raw: bytes, block: int) -> bytes:
    at = fmt.HEADER_NBYTES + block * fmt.ENTRY_NBYTES
    return raw[at : at + fmt.ENTRY_NBYTES]


def intact(raw: bytes, block: int) -> bool:
    """Whether ``block``'s entry and published bytes are as the pristine segment has them."""
    base, (_, data) = pristine()[0], pristine()[1][block]
    start = fmt.payload_offset(GEO.num_blocks) + block * GEO.block_nbytes
    return (
        _entry(raw, block) == _entry(base, block) and raw[start : start + len(data)] == base[start : start + len(data)]
    )


def check(raw: bytes, cold, found, got) -> None:
    base, published = pristine()
    if len(raw) == len(base) and raw[:HEADER_CHECKED] == base[:HEADER_CHECKED]:
        assert cold is None, f"an intact header started cold: {cold}"
    if cold is not None:
        assert found == [], "a cold start recovered blocks"
        return
    for r in found:
        # An entry whose checksum field is the original one verified only with the original
        # key, length and bytes (else a collision). A rewritten checksum is a forgery (the
        # fuzzer can learn checksums from comparisons), which no format without a secret stops.
        if _entry(raw, r.block)[16:24] == _entry(base, r.block)[16:24]:
            assert (r.key, got[r.block]) == published.get(r.block), f"wrong block {r.block} recovered"
    recovered = {r.block for r in found}
    assert all(b in recovered for b in published if intact(raw, b)), "an intact block was lost"


def one_input(data: bytes) -> None:
    raw = damaged(data)
    path = config().path
    Path(path).write_bytes(raw)
    try:
        infos = ShmSegment.list_segments(config().directory)
        assert [i.path for i in infos] == [path]
        cold, found, _, got, seq = attach()
        check(raw, cold, found, got)
        assert seq > max((r.seq for r in found), default=0), "seq went backwards"
        cold, again, _, got, _ = attach()
        block, key, new = AFTER
        assert cold is None and (again[-1].block, again[-1].key, got[block]) == (block, key, new)
    finally:
        os.unlink(path)


def main() -> None:
    _mutate.fuzz(one_input, atheris, before=remove_stale)


if __name__ == "__main__":
    main()
