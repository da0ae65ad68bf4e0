"""Unit tests for the shared-memory warm-boot segment (tiersync.tiers.shm)."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import struct
import subprocess
import tempfile

import numpy as np
import pytest

from tiersync.errors import CapacityError, ClosedError, UsageError
from tiersync.tiers import shm_format as fmt
from tiersync.tiers.shm import ColdStart, Geometry, ShmConfig, ShmSegment

DIGEST = bytes(range(16))
GEO = Geometry(num_blocks=8, block_nbytes=8192, layout_digest=DIGEST)


@pytest.fixture
def shm_dir():
    """A private directory on /dev/shm (tmpfs) when there is one, else on the temp file system."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    path = tempfile.mkdtemp(prefix="tiersync-test-", dir=base)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def cfg(directory: str, model_id: str = "llama-3-8b@v1", key: str = "k0") -> ShmConfig:
    return ShmConfig(key=key, model_id=model_id, directory=directory)


def fill(seg: ShmSegment, block: int, seed: int, nbytes: int | None = None) -> bytes:
    """Write deterministic random bytes into ``block`` and publish them; return the bytes."""
    n = seg.geometry.block_nbytes if nbytes is None else nbytes
    data = np.random.default_rng([block, seed]).bytes(n)
    start = block * seg.geometry.block_nbytes
    seg.invalidate([block])
    seg.payload[start : start + n] = data
    seg.publish(block, f"key-{block}-{seed}".encode(), nbytes)
    return data


def block_bytes(seg: ShmSegment, block: int, nbytes: int) -> bytes:
    start = block * seg.geometry.block_nbytes
    return bytes(seg.payload[start : start + nbytes])


def populate(directory: str, blocks=(0, 3, 5)) -> dict[int, bytes]:
    with ShmSegment.open(cfg(directory), GEO) as seg:
        return {b: fill(seg, b, seed=1) for b in blocks}


def reopen_reason(directory: str, geometry: Geometry = GEO, model_id: str = "llama-3-8b@v1"):
    with ShmSegment.open(cfg(directory, model_id), geometry) as seg:
        return seg.cold_start, seg.recover()


# --- round trip -------------------------------------------------------------------------


def test_format_attach_recover_round_trip(shm_dir):
    with ShmSegment.open(cfg(shm_dir), GEO) as seg:
        assert seg.cold_start is ColdStart.NEW
        assert seg.recover() == []
        a = fill(seg, 2, seed=1)
        b = fill(seg, 6, seed=2, nbytes=100)
        c = fill(seg, 2, seed=3)  # rewrite: newest seq wins, old bytes gone
        assert c != a
    assert os.path.getsize(cfg(shm_dir).path) == fmt.payload_offset(8) + 8 * 8192
    with ShmSegment.open(cfg(shm_dir), GEO) as seg:
        assert seg.cold_start is None
        rec = seg.recover()
        assert [(r.block, r.key, r.seq, r.nbytes) for r in rec] == [
            (6, b"key-6-2", 2, 100),
            (2, b"key-2-3", 3, 8192),
        ]
        assert block_bytes(seg, 6, 100) == b and block_bytes(seg, 2, 8192) == c
        assert seg.stats.recovered == 2 and seg.stats.torn == 0
        assert seg.publish(0, b"next") == 4  # seq continues after the largest one found


def test_payload_is_page_aligned_and_address_matches(shm_dir):
    with ShmSegment.open(cfg(shm_dir), GEO) as seg:
        assert len(seg.payload) == GEO.num_blocks * GEO.block_nbytes and not seg.payload.readonly
        assert seg.address % fmt.PAGE == 0
        seg.payload[:4] = b"abcd"
        assert ctypes.string_at(seg.address, 4) == b"abcd"
        ctypes.memmove(seg.address + 4, b"efgh", 4)
        assert bytes(seg.payload[:8]) == b"abcdefgh"


def test_invalidate_hides_block_and_checks_indices(shm_dir):
    populate(shm_dir)
    with ShmSegment.open(cfg(shm_dir), GEO) as seg:
        with pytest.raises(UsageError):
            seg.invalidate([0, 8])  # all-or-nothing: block 0 stays valid
        seg.invalidate([3])
        assert [r.block for r in seg.recover()] == [0, 5]
    _, rec = reopen_reason(shm_dir)
    assert [r.block for r in rec] == [0, 5]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(block=8, key=b"k"),
        dict(block=-1, key=b"k"),
        dict(block=0, key=b"x" * 33),
        dict(block=0, key="str"),
        dict(block=0, key=b"k", nbytes=8193),
        dict(block=0, key=b"k", nbytes=-1),
    ],
)
def test_publish_rejects_bad_arguments(shm_dir, kwargs):
    with ShmSegment.open(cfg(shm_dir), GEO) as seg, pytest.raises(UsageError):
        seg.publish(**kwargs)


def test_closed_segment_refuses_calls_and_close_is_idempotent(shm_dir):
    seg = ShmSegment.open(cfg(shm_dir), GEO)
    seg.close()
    seg.close()
    for call in (seg.recover, lambda: seg.publish(0, b"k"), lambda: seg.invalidate([0])):
        with pytest.raises(ClosedError):
            call()


def test_close_with_live_payload_view_refuses_then_succeeds(shm_dir):
    seg = ShmSegment.open(cfg(shm_dir), GEO)
    arr = np.frombuffer(seg.payload, dtype=np.uint8)
    with pytest.raises(UsageError, match="release"):
        seg.close()
    del arr
    assert len(seg.payload) == GEO.num_blocks * GEO.block_nbytes  # still attached and usable
    seg.close()
    assert seg.closed


# --- cold starts ------------------------------------------------------------------------


def test_model_mismatch_starts_empty_and_reformats(shm_dir):
    populate(shm_dir)
    assert reopen_reason(shm_dir, model_id="llama-3-8b@v2") == (ColdStart.MODEL_MISMATCH, [])
    [info] = ShmSegment.list_segments(shm_dir)
    assert info.model_id == "llama-3-8b@v2" and info.valid_blocks == 0
    assert reopen_reason(shm_dir, model_id="llama-3-8b@v2") == (None, [])
    assert reopen_reason(shm_dir)[0] is ColdStart.MODEL_MISMATCH


@pytest.mark.parametrize(
    "geometry",
    [Geometry(9, 8192, DIGEST), Geometry(8, 4096, DIGEST), Geometry(8, 8192, bytes(16))],
    ids=["num_blocks", "block_nbytes", "layout_digest"],
)
def test_geometry_mismatch_starts_empty(shm_dir, geometry):
    populate(shm_dir)
    assert reopen_reason(shm_dir, geometry) == (ColdStart.GEOMETRY_MISMATCH, [])
    expected = fmt.payload_offset(geometry.num_blocks) + geometry.num_blocks * geometry.block_nbytes
    assert os.path.getsize(cfg(shm_dir).path) == expected


@pytest.mark.parametrize(
    ("size", "reason"),
    [
        (0, ColdStart.NEW),
        (100, ColdStart.CORRUPT_HEADER),
        (fmt.HEADER_NBYTES + 64, ColdStart.SIZE_MISMATCH),
        (-1, ColdStart.SIZE_MISMATCH),
        (+1, ColdStart.SIZE_MISMATCH),
    ],
    ids=["empty", "into-header", "into-manifest", "payload-short", "too-long"],
)
def test_truncated_or_extended_file_is_cold(shm_dir, size, reason):
    populate(shm_dir)
    path = cfg(shm_dir).path
    full = os.path.getsize(path)
    os.truncate(path, full + size if size in (-1, 1) else size)
    assert reopen_reason(shm_dir) == (reason, [])
    assert os.path.getsize(path) == full


@pytest.mark.parametrize(
    ("offset", "reason"),
    [
        (0, ColdStart.CORRUPT_HEADER),
        (16, ColdStart.CORRUPT_HEADER),
        (30, ColdStart.CORRUPT_HEADER),
        (120, ColdStart.CORRUPT_HEADER),
        (400, ColdStart.CORRUPT_HEADER),
    ],
    ids=["magic", "checksum", "num_blocks", "model_id", "server_name"],
)
def test_corrupt_header_byte_is_cold(shm_dir, offset, reason):
    populate(shm_dir)
    with open(cfg(shm_dir).path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))
    assert reopen_reason(shm_dir) == (reason, [])


def test_other_format_version_is_cold(shm_dir):
    populate(shm_dir)
    with open(cfg(shm_dir).path, "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<I", fmt.FORMAT_VERSION + 1))
    assert reopen_reason(shm_dir) == (ColdStart.VERSION_MISMATCH, [])


def test_garbage_file_is_cold(shm_dir):
    with open(cfg(shm_dir).path, "wb") as f:
        f.write(os.urandom(3 * fmt.HEADER_NBYTES))
    assert reopen_reason(shm_dir) == (ColdStart.CORRUPT_HEADER, [])


def test_one_log_line_says_why_cold(shm_dir, caplog):
    populate(shm_dir)
    with caplog.at_level(logging.INFO, logger="tiersync.shm"):
        reopen_reason(shm_dir, model_id="other")
    [record] = caplog.records
    assert record.levelno == logging.WARNING and "model_mismatch" in record.getMessage()
    assert "'other'" in record.getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tiersync.shm"):
        reopen_reason(shm_dir, model_id="other")
    [record] = caplog.records
    assert record.levelno == logging.INFO and "warm" in record.getMessage()


# --- torn and malformed entries ---------------------------------------------------------


def test_torn_payload_is_never_recovered(shm_dir):
    data = populate(shm_dir)
    with ShmSegment.open(cfg(shm_dir), GEO) as seg:
        seg.payload[3 * 8192 + 77] ^= 0xFF  # bytes changed after publish, flag still valid
        rec = seg.recover()
        assert [r.block for r in rec] == [0, 5]
        assert all(block_bytes(seg, r.block, r.nbytes) == data[r.block] for r in rec)
        assert seg.stats.torn == 1
    with ShmSegment.open(cfg(shm_dir), GEO) as seg:  # invalidated on disk, not counted again
        assert [r.block for r in seg.recover()] == [0, 5] and seg.stats.torn == 0


def _poke_entry(directory: str, block: int, field_offset: int, value: bytes) -> None:
    with open(cfg(directory).path, "r+b") as f:
        f.seek(fmt.HEADER_NBYTES + block * fmt.ENTRY_NBYTES + field_offset)
        f.write(value)


@pytest.mark.parametrize(
    ("field_offset", "value", "counter"),
    [
        (0, struct.pack("<Q", 999), "torn"),
        (30, b"!", "torn"),
        (16, struct.pack("<Q", 1), "torn"),
        (8, struct.pack("<Q", 10**6), "malformed"),
        (24, struct.pack("<I", 33), "malformed"),
        (60, struct.pack("<I", 1), "malformed"),
    ],
    ids=["seq", "key", "checksum", "nbytes", "key_len", "valid-garbage"],
)
def test_corrupt_entry_fields_are_dropped(shm_dir, field_offset, value, counter):
    populate(shm_dir)
    _poke_entry(shm_dir, 3, field_offset, value)
    with ShmSegment.open(cfg(shm_dir), GEO) as seg:
        assert [r.block for r in seg.recover()] == [0, 5]
        assert getattr(seg.stats, counter) == 1


# --- names, environment, locking --------------------------------------------------------


@pytest.mark.parametrize("bad", ["", "a/b", "../x", "x" * 65, "sp ace", "é", None])
@pytest.mark.parametrize("field", ["key", "server_name"])
def test_invalid_names_are_refused(field, bad):
    kwargs = {"key": "k", "model_id": "m", field: bad}
    with pytest.raises(UsageError) as err:
        ShmConfig(**kwargs)
    assert err.value.argument == field


@pytest.mark.parametrize("bad", ["", "x" * 257, "é" * 129, 7])
def test_invalid_model_id_is_refused(bad):
    with pytest.raises(UsageError) as err:
        ShmConfig(key="k", model_id=bad)
    assert err.value.argument == "model_id"


def test_path_and_limits():
    c = ShmConfig(key="a.b_c-9", model_id="m" * 256, server_name="srv-1")
    assert c.path == "/dev/shm/tiersync-srv-1-a.b_c-9"
    for bad in (dict(num_blocks=0), dict(block_nbytes=-1), dict(layout_digest=b"short"), dict(num_blocks=True)):
        with pytest.raises(UsageError):
            Geometry(**{"num_blocks": 1, "block_nbytes": 1, "layout_digest": DIGEST, **bad})


def test_from_env():
    assert ShmConfig.from_env({}) is None
    assert ShmConfig.from_env({"TIERSYNC_SHM_KEY": ""}) is None
    env = {
        "TIERSYNC_SHM_KEY": "k1",
        "TIERSYNC_MODEL_ID": "m@1",
        "TIERSYNC_SERVER_NAME": "s",
        "TIERSYNC_SHM_DIR": "/tmp/x",
    }
    assert ShmConfig.from_env(env) == ShmConfig(key="k1", model_id="m@1", server_name="s", directory="/tmp/x")
    assert ShmConfig.from_env({"TIERSYNC_SHM_KEY": "k", "TIERSYNC_MODEL_ID": "m"}).path == "/dev/shm/tiersync-default-k"
    with pytest.raises(UsageError, match="TIERSYNC_MODEL_ID"):
        ShmConfig.from_env({"TIERSYNC_SHM_KEY": "k"})
    with pytest.raises(UsageError):
        ShmConfig.from_env({"TIERSYNC_SHM_KEY": "bad/key", "TIERSYNC_MODEL_ID": "m"})


def test_second_attach_is_refused_until_close(shm_dir):
    seg = ShmSegment.open(cfg(shm_dir), GEO)
    with pytest.raises(UsageError, match="attached by another live process") as err:
        ShmSegment.open(cfg(shm_dir), GEO)
    assert cfg(shm_dir).path in str(err.value)
    seg.close()
    ShmSegment.open(cfg(shm_dir), GEO).close()


# --- file system failures ---------------------------------------------------------------


def test_missing_directory_names_the_path(shm_dir):
    c = cfg(os.path.join(shm_dir, "missing"))
    with pytest.raises(UsageError) as err:
        ShmSegment.open(c, GEO)
    assert c.path in str(err.value) and err.value.argument == "config.directory"


def _mount_tmpfs(directory: str, options: str) -> None:
    """Mount a tmpfs on ``directory`` (root only) or skip the test saying why."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", directory], check=False, capture_output=True, text=True
    )
    if res.returncode != 0:
        pytest.skip(f"cannot mount tmpfs here: {res.stderr.strip()}")


@pytest.fixture
def mount_point(tmp_path):
    path = tmp_path / "mnt"
    path.mkdir()
    yield str(path)
    subprocess.run(["umount", str(path)], check=False, capture_output=True)


def test_unwritable_directory_names_the_path(mount_point):
    root = os.geteuid() == 0
    if root:  # root ignores permission bits: use a read-only file system
        _mount_tmpfs(mount_point, "ro,size=1m")
    else:
        os.chmod(mount_point, 0o555)
    c = cfg(mount_point)
    try:
        with pytest.raises(UsageError) as err:
            ShmSegment.open(c, GEO)
        assert c.path in str(err.value) and err.value.argument == "config.directory"
    finally:
        if not root:
            os.chmod(mount_point, 0o755)


def test_too_small_tmpfs_fails_at_open(mount_point):
    _mount_tmpfs(mount_point, "size=1m")
    c = cfg(mount_point)
    with pytest.raises(CapacityError) as err:
        ShmSegment.open(c, Geometry(num_blocks=64, block_nbytes=64 * 1024, layout_digest=DIGEST))
    assert c.path in str(err.value) and err.value.requested > 4 * 2**20 and err.value.free <= 2**20
    assert not os.path.exists(c.path)
    small = Geometry(num_blocks=4, block_nbytes=64 * 1024, layout_digest=DIGEST)
    with ShmSegment.open(c, small) as seg:  # what fits still works
        assert seg.cold_start is ColdStart.NEW


# --- list and reclaim -------------------------------------------------------------------


def test_list_segments_and_reclaim(shm_dir):
    populate(shm_dir)
    with open(os.path.join(shm_dir, "tiersync-default-broken"), "wb") as f:
        f.write(b"junk")
    open(os.path.join(shm_dir, "unrelated"), "wb").close()
    broken, good = ShmSegment.list_segments(shm_dir)  # sorted by path
    assert (good.server_name, good.key, good.model_id, good.valid_blocks, good.problem) == (
        "default",
        "k0",
        "llama-3-8b@v1",
        3,
        None,
    )
    assert good.size == os.path.getsize(good.path) and good.num_blocks == 8
    assert broken.problem is ColdStart.CORRUPT_HEADER and broken.key is None
    with ShmSegment.open(cfg(shm_dir), GEO), pytest.raises(UsageError, match="attached"):
        ShmSegment.reclaim(good.path)
    ShmSegment.reclaim(good.path)
    ShmSegment.reclaim(broken.path)
    assert os.listdir(shm_dir) == ["unrelated"]
    for bad in (os.path.join(shm_dir, "unrelated"), good.path):
        with pytest.raises(UsageError):
            ShmSegment.reclaim(bad)
    with pytest.raises(UsageError):
        ShmSegment.list_segments(os.path.join(shm_dir, "missing"))
