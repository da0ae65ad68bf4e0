"""atheris target: a storage-tier directory whose segment files (and tombstone sidecar) are damaged.

Run: ``python fuzz/storage_segment.py -max_total_time=3600`` (see fuzz/README.md). The
core is :func:`one_input`, which tests/test_fuzz_targets.py also runs without atheris.

Input: see :mod:`_mutate` (mode byte, then a mutation program applied to a directory the
real StorageTier wrote, or one raw segment file). Invariants (a failure raises, and the
fuzzer saves the input): opening never raises; no key is invented; a block read ``OK``
holds exactly its written bytes and any other status is MISSING or CORRUPT; an unchanged
segment serves all its live blocks; the deleted block stays deleted while its sidecar is
unchanged; a block read CORRUPT does not come back after a reopen.
"""

from __future__ import annotations

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
from tiersync.tiers import storage_format as fmt
from tiersync.tiers.storage import ReadStatus, StorageConfig, StorageTier

IDENT = bytes(range(16))
SIZES = (1000, 4096, 5000, 1)
BATCHES = [[b"fz-%d-%d" % (b, i) for i in range(n)] for b, n in enumerate((3, 4, 2))]
DELETED = BATCHES[1][1]
KEYS = [k for batch in BATCHES for k in batch]
NBYTES = {k: SIZES[i % len(SIZES)] for i, k in enumerate(KEYS)}
_pristine: dict = {}


def block(key: bytes, nbytes: int) -> bytes:
    """The only bytes ``key`` may ever hold."""
    return np.random.default_rng(list(key)).bytes(nbytes)


def open_tier(directory: str) -> StorageTier:
    return StorageTier(StorageConfig(directory, IDENT, workers=1, read_depth=2, fsync=False))


def pristine() -> dict:
    """Built once per process: {"files": name -> bytes, "owners": segment -> keys, "sidecar": name}."""
    if not _pristine:
        d = tempfile.mkdtemp(prefix="tiersync-fuzz-storage-pristine-")
        try:
            with open_tier(d) as t:
                for batch in BATCHES:
                    t.write(batch, [memoryview(block(k, NBYTES[k])) for k in batch]).result(30)
                t.delete([DELETED])
            names = sorted(os.listdir(d))
            owners = dict(zip([n for n in names if n.endswith(fmt.SUFFIX)], BATCHES))
            _pristine.update(
                files={n: Path(d, n).read_bytes() for n in names},
                owners=owners,
                sidecar=next(n for n, ks in owners.items() if DELETED in ks) + fmt.TOMB_SUFFIX,
            )
        finally:
            shutil.rmtree(d, ignore_errors=True)
    return _pristine


def damage(data: bytes, directory: str) -> set[str] | None:
    """Write the damaged directory; returns the names that changed (None: a raw segment)."""
    if data[:1] and data[0] % 2:
        Path(directory, f"{IDENT.hex()}-fuzz-0000000000{fmt.SUFFIX}").write_bytes(data[1:])
        return None
    files = pristine()["files"]
    names = sorted(files)
    bufs = {n: bytearray(b) for n, b in files.items()}
    for kind, which, n, offset, value in _mutate.decode(data[1:]):
        name = names[which % len(names)]
        bufs[name] = _mutate.apply(bufs[name], kind, n, offset, value)
    for name, buf in bufs.items():
        Path(directory, name).write_bytes(buf)
    return {n for n in names if bytes(bufs[n]) != files[n]}


def read(tier: StorageTier, keys: list[bytes], sizes: list[int]) -> dict:
    outs = [bytearray(n) for n in sizes]
    statuses = tier.read(keys, [memoryview(o) for o in outs]).result(60)
    return {k: (s, bytes(o)) for k, s, o in zip(keys, statuses, outs)}


def check(got: dict, known: set[bytes], changed: set[str]) -> None:
    p = pristine()
    assert known <= set(KEYS), "a key that was never written"
    for k, (status, data) in got.items():
        assert status in (ReadStatus.OK, ReadStatus.MISSING, ReadStatus.CORRUPT), (k, status)
        assert status is not ReadStatus.OK or data == block(k, NBYTES[k]), f"wrong bytes served for {k!r}"
    for name, batch in p["owners"].items():
        if name not in changed:
            assert all(got[k][0] is ReadStatus.OK for k in batch if k != DELETED), f"intact {name} lost blocks"
    if p["sidecar"] not in changed:
        assert DELETED not in known, "a deleted block came back"


def one_input(data: bytes) -> None:
    directory = tempfile.mkdtemp(prefix="tiersync-fuzz-storage-")
    try:
        changed = damage(data, directory)
        with open_tier(directory) as tier:
            known = set(tier.keys())
            if changed is None:  # a raw segment: any key and length it validly declares
                lengths = [tier._locs[k].record.length for k in known]  # harness only: the stored sizes
                statuses = {s for s, _ in read(tier, list(known), lengths).values()}
                assert statuses <= {ReadStatus.OK, ReadStatus.MISSING, ReadStatus.CORRUPT}, statuses
                return
            got = read(tier, KEYS, [NBYTES[k] for k in KEYS])
        check(got, known, changed)
        corrupt = {k for k, (s, _) in got.items() if s is ReadStatus.CORRUPT}
        with open_tier(directory) as tier:
            assert not corrupt & set(tier.keys()), "a block read CORRUPT came back after a reopen"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    _mutate.fuzz(one_input, atheris)


if __name__ == "__main__":
    main()
