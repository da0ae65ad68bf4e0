"""Durable deletion: what the tier dropped stays dropped after a restart or a SIGKILL,
and a damaged tombstone can only bring back a block with its own, verified bytes."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys

from _storage_helpers import block_bytes, key, open_tier, read_keys, write_keys
from tiersync.tiers import storage_format as fmt
from tiersync.tiers.storage import ReadStatus

NB = 8192
write = functools.partial(write_keys, nbytes=NB)  # write(tier, keys) / read(tier, keys)
read = functools.partial(read_keys, nbytes=NB)
CHILD = os.path.join(os.path.dirname(__file__), "_storage_child.py")


def files(path, suffix):
    return sorted(n for n in os.listdir(path) if n.endswith(suffix))


def test_partly_deleted_segment_does_not_come_back_after_restart(sdir):
    keys = [key(i) for i in range(4)]
    with open_tier(sdir) as t:
        write(t, keys)
        t.delete(keys[1:3])
        assert len(files(sdir, fmt.SUFFIX)) == 1 and len(files(sdir, fmt.TOMB_SUFFIX)) == 1
    with open_tier(sdir) as t:
        assert sorted(t.keys()) == sorted([keys[0], keys[3]])
        assert t.stats().deleted == 2
        st, data = read(t, keys)
        assert st == [ReadStatus.OK, ReadStatus.MISSING, ReadStatus.MISSING, ReadStatus.OK]
        assert data[0] == block_bytes(keys[0], NB) and data[3] == block_bytes(keys[3], NB)


def test_last_delete_unlinks_segment_and_sidecar(sdir):
    keys = [key(i) for i in range(2)]
    with open_tier(sdir) as t:
        write(t, keys)
        t.delete(keys[:1])
        t.delete(keys[1:])
        assert os.listdir(sdir) == []


def test_a_superseded_copy_is_deleted_too(sdir):
    a, b = key(1), key(2)
    with open_tier(sdir) as t:
        write(t, [a, b])
        write(t, [a])  # a newer copy of a in a second segment
        t.delete([a])
    with open_tier(sdir) as t:
        assert t.keys() == [b]


def test_scan_finds_a_duplicate_and_deletes_all_copies(sdir):
    a = key(7)
    for _ in range(2):  # two processes wrote the same key without seeing each other
        with open_tier(sdir) as t:
            t._index.seen.update(os.listdir(sdir))
            t._locs.clear()
            write(t, [a])
    assert len(files(sdir, fmt.SUFFIX)) == 2
    with open_tier(sdir) as t:
        assert t.keys() == [a]
        t.delete([a])
    with open_tier(sdir) as t:
        assert t.keys() == []


def test_deletion_survives_sigkill(sdir):
    child = subprocess.Popen(
        [sys.executable, CHILD, "delete", sdir], stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True
    )
    try:
        line = child.stdout.readline()
        assert line.startswith("DELETED"), line
        deleted = {bytes.fromhex(h) for h in line.split()[1:]}
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        assert child.returncode == -signal.SIGKILL
    finally:
        child.kill()
        child.wait()
    kept = [key(i, "del") for i in range(8)][1::2]
    with open_tier(sdir) as t:
        assert sorted(t.keys()) == sorted(kept) and not deleted & set(t.keys())
        st, data = read(t, kept)
        assert st == [ReadStatus.OK] * 4 and data == [block_bytes(k, NB) for k in kept]


def test_damaged_tombstone_brings_back_only_verified_bytes(sdir):
    keys = [key(i) for i in range(3)]
    with open_tier(sdir) as t:
        write(t, keys)
        t.delete(keys[:2])
    side = os.path.join(sdir, files(sdir, fmt.TOMB_SUFFIX)[0])
    with open(side, "r+b") as f:  # damage the first record; the second stays valid
        f.seek(10)
        f.write(b"\xff\xff")
    with open(side, "ab") as f:
        f.write(b"torn")  # a partial record at the end is ignored
    with open_tier(sdir) as t:
        assert sorted(t.keys()) == sorted([keys[0], keys[2]])
        st, data = read(t, [keys[0], keys[2]])
        assert st == [ReadStatus.OK] * 2 and data == [block_bytes(k, NB) for k in (keys[0], keys[2])]


def test_corrupt_block_found_by_a_read_stays_gone(sdir):
    keys = [key(i) for i in range(2)]
    with open_tier(sdir) as t:
        write(t, keys)
        seg = os.path.join(sdir, files(sdir, fmt.SUFFIX)[0])
        with open(seg, "r+b") as f:
            f.seek(fmt.header_nbytes(2) + 5)
            f.write(b"\x00\xff")
        assert read(t, keys)[0] == [ReadStatus.CORRUPT, ReadStatus.OK]
    with open_tier(sdir) as t:
        assert t.keys() == [keys[1]]


def test_orphan_sidecar_is_removed_on_open(sdir):
    with open_tier(sdir) as t:
        write(t, [key(1), key(2)])
        t.delete([key(1)])
    seg = files(sdir, fmt.SUFFIX)[0]
    os.unlink(os.path.join(sdir, seg))  # e.g. a crash between the segment's unlink and its sidecar's
    with open_tier(sdir):
        assert os.listdir(sdir) == []


def test_tombstone_records_round_trip():
    ks = [key(i) for i in range(3)] + [b"x"]
    assert fmt.parse_tombstones(fmt.encode_tombstones(ks)) == set(ks)
    assert fmt.parse_tombstones(b"") == set() and fmt.parse_tombstones(b"\0" * 64) == set()
