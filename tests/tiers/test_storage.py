"""Storage tier: round trips, restart scan, identity isolation, corruption, full disk, permissions."""

from __future__ import annotations

import errno
import functools
import mmap
import os

import pytest

from _storage_helpers import (
    IDENT,
    block_bytes,
    key,
    open_tier,
    read_keys,
    remount_ro,
    segments,
    tmpfs,
    write_keys,
)
from tiersync.errors import CapacityError, ClosedError, UsageError
from tiersync.tiers import storage_format as fmt
from tiersync.tiers import storage_io
from tiersync.tiers.storage import ReadStatus, StorageConfig

NB = 16384
write = functools.partial(write_keys, nbytes=NB)  # write(tier, keys) / read(tier, keys)
read = functools.partial(read_keys, nbytes=NB)


def test_a_writable_directory_is_probed_and_the_probe_leaves_nothing(sdir):
    with open_tier(sdir) as t:
        assert t.writable is True
    assert os.listdir(sdir) == []


def test_round_trip_and_restart_scan(sdir):
    keys = [key(i) for i in range(6)]
    with open_tier(sdir) as t:
        write(t, keys[:4])
        write(t, keys[4:], nbytes=NB)
        assert t.num_blocks == 6 and len(segments(sdir)) == 2
    with open_tier(sdir) as t:  # a new process would do the same
        assert t.keys() == keys
        st, data = read(t, keys)
        assert st == [ReadStatus.OK] * 6 and data == [block_bytes(k, NB) for k in keys]
        assert t.stats().bytes_read == 6 * NB


def test_direct_writes_round_trip(sdir):
    keys = [key(i, "direct") for i in range(4)]
    bufs = [mmap.mmap(-1, NB) for _ in keys]  # page-aligned sources: eligible for O_DIRECT
    for b, k in zip(bufs, keys):
        b[:] = block_bytes(k, NB)
    with open_tier(sdir, direct_writes=True) as t:
        t.write(keys, [memoryview(b) for b in bufs]).result(10)
        outs = [mmap.mmap(-1, NB) for _ in keys]
        assert t.read(keys, [memoryview(o) for o in outs]).result(10) == [ReadStatus.OK] * 4
        assert [o[:] for o in outs] == [block_bytes(k, NB) for k in keys]


def test_unaligned_sizes_and_buffered_fallback(sdir):
    keys = [key(i, "odd") for i in range(3)]
    with open_tier(sdir, direct_io=False) as t:
        write(t, keys, nbytes=1000)
        st, data = read(t, keys, nbytes=1000)
        assert st == [ReadStatus.OK] * 3 and data == [block_bytes(k, 1000) for k in keys]
        assert not t.stats().direct_io


def test_unknown_key_is_a_miss(sdir):
    with open_tier(sdir) as t:
        assert read(t, [key(99)])[0] == [ReadStatus.MISSING]
        assert not t.contains(key(99))


def test_other_identity_is_ignored(sdir):
    with open_tier(sdir) as t:
        write(t, [key(1)])
    with open_tier(sdir, ident=b"\xee" * 16) as other:
        assert other.num_blocks == 0 and other.stats().foreign_segments == 1
        assert read(other, [key(1)])[0] == [ReadStatus.MISSING]


def test_corrupt_payload_is_detected_on_read_and_never_served(sdir):
    with open_tier(sdir) as t:
        write(t, [key(1), key(2)])
        seg = os.path.join(sdir, segments(sdir)[0])
        with open(seg, "r+b") as f:  # flip bytes in the second payload
            f.seek(fmt.header_nbytes(2) + NB + 10)
            f.write(b"\x00\xff\x00\xff")
        st, data = read(t, [key(1), key(2)])
        assert st == [ReadStatus.OK, ReadStatus.CORRUPT] and data[0] == block_bytes(key(1), NB)
        assert not t.contains(key(2)) and t.stats().read_corrupt == 1
        assert read(t, [key(2)])[0] == [ReadStatus.MISSING]  # forgotten: a miss from now on


def test_corrupt_descriptor_and_truncated_file_are_skipped_and_counted(sdir):
    with open_tier(sdir) as t:
        write(t, [key(i) for i in range(3)])
        write(t, [key(i) for i in range(3, 6)])
    first, second = (os.path.join(sdir, s) for s in segments(sdir))
    with open(first, "r+b") as f:
        f.seek(fmt.HEAD_NBYTES + fmt.DESC_NBYTES + 30)  # inside descriptor 1 (its key)
        f.write(b"garbage")
    os.truncate(second, fmt.header_nbytes(3) + NB + 5)  # records 1 and 2 run past the end
    with open_tier(sdir) as t:
        s = t.stats()
        assert s.corrupt == 1 and s.truncated == 2
        assert sorted(t.keys()) == sorted([key(0), key(2), key(3)])
        st, data = read(t, [key(0), key(2), key(3)])
        assert st == [ReadStatus.OK] * 3 and data == [block_bytes(k, NB) for k in (key(0), key(2), key(3))]
    with open(first, "r+b") as f:
        f.write(b"not a segment at all")
    with open_tier(sdir) as t:
        assert t.stats().corrupt >= 1 and key(0) not in t.keys()  # noqa: SIM118 - keys() is the tier's listing; a tier has no __contains__


@pytest.mark.parametrize("flip", [0x01, 0x80])
def test_a_damaged_record_count_never_sizes_a_read_and_loses_no_record(sdir, flip):
    """The count is used before any checksum covers it: a flipped high byte once made the
    open ask for hundreds of GB. Now the header counts as one corrupt and every record is
    still found by its own checksum; the directory and the other segment open as usual."""
    with open_tier(sdir) as t:
        write(t, [key(i) for i in range(3)])
        write(t, [key(i) for i in range(3, 5)])
    first = os.path.join(sdir, segments(sdir)[0])
    with open(first, "r+b") as f:
        f.seek(12 + 3)  # the high byte of the u32 record count
        f.write(bytes([flip]))
    with open_tier(sdir) as t:
        assert t.stats().corrupt == 1 and sorted(t.keys()) == sorted(key(i) for i in range(5))
        st, data = read(t, [key(i) for i in range(5)])
        assert st == [ReadStatus.OK] * 5 and data == [block_bytes(key(i), NB) for i in range(5)]


def test_a_view_of_the_wrong_size_is_refused_and_the_block_stays(sdir):
    """A destination one byte short is the caller's mistake: UsageError naming ``views``, nothing
    read, the good block neither counted corrupt nor deleted (it once was, for good)."""
    with open_tier(sdir) as t:
        write(t, [key(1), key(2)])
        for bad in (memoryview(bytearray(NB - 1)), memoryview(bytes(NB))):
            with pytest.raises(UsageError) as exc:
                t.read([key(1), key(2)], [memoryview(bytearray(NB)), bad])
            assert exc.value.argument == "views"
        assert t.contains(key(2)) and t.stats().read_corrupt == 0
        st, data = read(t, [key(1), key(2)])
        assert st == [ReadStatus.OK] * 2 and data == [block_bytes(key(1), NB), block_bytes(key(2), NB)]
    with open_tier(sdir) as t:
        assert sorted(t.keys()) == sorted([key(1), key(2)])


def test_truncated_after_scan_reads_as_corrupt(sdir):
    with open_tier(sdir) as t:
        write(t, [key(1)])
        os.truncate(os.path.join(sdir, segments(sdir)[0]), fmt.header_nbytes(1) + 100)
        assert read(t, [key(1)])[0] == [ReadStatus.CORRUPT]


def test_vanished_segment_is_a_miss(sdir):
    with open_tier(sdir) as t:
        write(t, [key(1)])
        os.unlink(os.path.join(sdir, segments(sdir)[0]))
        assert read(t, [key(1)])[0] == [ReadStatus.MISSING]


def test_delete_unlinks_dead_segments_and_orphans_are_cleaned(sdir):
    with open_tier(sdir) as t:
        write(t, [key(1), key(2)])
        t.delete([key(1)])
        assert len(segments(sdir)) == 1
        t.delete([key(2)])
        assert segments(sdir) == []
        orphan = os.path.join(sdir, fmt.TMP_PREFIX + IDENT.hex() + "-" + t._host + ".999999999.abc-0000000000.seg")
        open(orphan, "wb").close()
    with open_tier(sdir):
        assert not os.path.exists(orphan)


def test_full_disk_is_a_clear_error_and_changes_nothing():
    with tmpfs("2m") as path:
        if path is None:
            pytest.skip("needs root and mount(8) to make a small tmpfs")
        with open_tier(path) as t:
            written = []
            with pytest.raises(CapacityError) as ei:
                for i in range(100):  # 100 x 64 KiB > 2 MiB
                    write(t, [key(i)], nbytes=65536)
                    written.append(key(i))
            assert ei.value.requested == 65536 and written
            assert sorted(t.keys()) == sorted(written)
            assert not [n for n in os.listdir(path) if n.startswith(fmt.TMP_PREFIX)]
            st, data = read(t, written, nbytes=65536)
            assert st == [ReadStatus.OK] * len(written)
            assert data == [block_bytes(k, 65536) for k in written]


def test_read_only_directory_refuses_writes_serves_reads():
    with tmpfs("4m") as path:
        if path is None:
            pytest.skip("needs root and mount(8) to make a tmpfs")
        with open_tier(path) as t:
            write(t, [key(1)])
        assert remount_ro(path)
        with open_tier(path) as t:
            assert t.writable is False  # said at construction (a WARNING), not at the first write
            with pytest.raises(UsageError) as ei:
                write(t, [key(2)])
            assert ei.value.argument == "StorageConfig.directory"
            assert t.keys() == [key(1)] and read(t, [key(1)])[0] == [ReadStatus.OK]


def test_permission_denied_write_and_read(sdir, monkeypatch):
    with open_tier(sdir) as t:
        write(t, [key(1)])

        def denied(*a, **k):
            raise PermissionError(errno.EACCES, "Permission denied")

        monkeypatch.setattr(storage_io, "open_for_write", denied)
        monkeypatch.setattr(storage_io, "open_for_read", denied)
        with pytest.raises(UsageError, match="not writable"):
            write(t, [key(2)])
        assert read(t, [key(1)])[0] == [ReadStatus.UNREADABLE]  # a miss, not a crash
        monkeypatch.undo()
        assert t.keys() == [key(1)] and read(t, [key(1)])[0] == [ReadStatus.OK]


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions")
def test_unreadable_directory_for_non_root(sdir):
    with open_tier(sdir) as t:
        write(t, [key(1)])
    os.chmod(sdir, 0o500)
    try:
        with open_tier(sdir) as t, pytest.raises(UsageError):
            write(t, [key(2)])
    finally:
        os.chmod(sdir, 0o700)


def test_bad_arguments_and_closed(sdir):
    with pytest.raises(UsageError, match=r"StorageConfig.identity"):
        StorageConfig(sdir, b"short")
    with pytest.raises(UsageError, match=r"StorageConfig.capacity_blocks"):
        StorageConfig(sdir, IDENT, capacity_blocks=0)
    t = open_tier(sdir)
    with pytest.raises(UsageError, match="keys"):
        t.write([b"x" * 33], [memoryview(bytearray(10))])
    with pytest.raises(UsageError, match="views"):
        t.write([key(1)], [])
    t.close()
    with pytest.raises(ClosedError):
        t.write([key(1)], [memoryview(bytearray(10))])
