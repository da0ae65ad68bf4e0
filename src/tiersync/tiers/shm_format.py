"""On-disk format of a tiersync shared-memory segment: byte layout, header parsing and the
file-level steps (open + lock, format, inspect) that :mod:`tiersync.tiers.shm` builds on.

A segment file is three regions, all integers little-endian::

    [0, HEADER_NBYTES)                 header (one 4 KiB page, see ``_HEADER``)
    [HEADER_NBYTES, manifest_end)      manifest: ``num_blocks`` entries of ENTRY_NBYTES
    [payload_offset, + payload_nbytes) payload, page aligned: block ``b`` at b * block_nbytes

Header fields, in order: magic ``b"TSYNCSHM"``, format version (u32), header size (u32),
header checksum (xxh3_64 of the packed header with this field zeroed), num_blocks,
block_nbytes, layout_digest (16 B), manifest offset, entry size (u32), payload offset,
payload size, model digest (xxh3_128 of the UTF-8 model id), the lengths then the bytes of
the model id (<= 256 B), server name and key (<= 64 B each).

Manifest entry (64 B): seq u64 @0, nbytes u64 @8, checksum u64 @16, key length u32 @24,
key 32 B @28, valid u32 @60. ``checksum`` is xxh3_64 over the entry's bytes [0, 8) + [8, 16) +
[24, 60) (seq, nbytes, key length, key) followed by the block's first ``nbytes`` payload
bytes, so a torn payload *or* torn entry fields fail it. ``valid`` holds VALID_MAGIC only
after every other field and the payload are written; any other non-zero value is garbage.
"""

from __future__ import annotations

import enum
import errno
import fcntl
import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

from tiersync.errors import CapacityError, UsageError

PREFIX = "tiersync-"  # segment file names start with this
NO_ROOM = {errno.ENOSPC, errno.ENOMEM, errno.EDQUOT, errno.EFBIG}
MAGIC = b"TSYNCSHM"
FORMAT_VERSION = 1
HEADER_NBYTES = 4096
ENTRY_NBYTES = 64
MAX_KEY_NBYTES = 32
MAX_MODEL_ID_NBYTES = 256
MAX_NAME_NBYTES = 64
VALID_MAGIC = 0x444C4156  # b"VALD" little-endian
PAGE = max(mmap.PAGESIZE, 4096)

_PREFIX = struct.Struct("<8sII")  # magic, version, header size: stable across versions
_HEADER = struct.Struct("<8sIIQQQ16sQIIQQ16sHHHH256s64s64s")
_CHECKSUM_AT = 16
_ENTRY_META = struct.Struct("<QQ")  # seq, nbytes
_ENTRY_KEY = struct.Struct("<I32s")  # key length, key
_VALID = struct.Struct("<I")
_VALID_AT = 60

_ENTRY = struct.Struct("<QQQI32sI")  # seq, nbytes, checksum, key length, key, valid


@dataclass(frozen=True, slots=True)
class Entry:
    """One decoded manifest entry (fields as stored, unverified)."""

    seq: int
    nbytes: int
    checksum: int
    key_len: int
    raw_key: bytes
    valid: int

    @property
    def key(self) -> bytes:
        return self.raw_key[: self.key_len]


def read_entries(manifest: bytes) -> list[Entry]:
    """Decode a manifest (``num_blocks * ENTRY_NBYTES`` bytes); index = block."""
    return [Entry(*fields) for fields in _ENTRY.iter_unpack(manifest)]


class ColdStart(enum.Enum):
    """Why :meth:`ShmSegment.open` formatted the segment instead of attaching."""

    NEW = "new"  #: no segment file (or an empty one) existed
    MODEL_MISMATCH = "model_mismatch"  #: written for another model identity
    GEOMETRY_MISMATCH = "geometry_mismatch"  #: other num_blocks / block_nbytes / layout
    SIZE_MISMATCH = "size_mismatch"  #: file size differs from the header's regions
    CORRUPT_HEADER = "corrupt_header"  #: bad magic, checksum, offsets or a truncated header
    VERSION_MISMATCH = "version_mismatch"  #: written by another format version


@dataclass(frozen=True, slots=True)
class Header:
    """A decoded, checksum-verified header."""

    num_blocks: int
    block_nbytes: int
    layout_digest: bytes
    manifest_offset: int
    payload_offset: int
    payload_nbytes: int
    model_digest: bytes
    model_id: str
    server_name: str
    key: str

    @property
    def file_nbytes(self) -> int:
        """Exact size the segment file must have."""
        return self.payload_offset + self.payload_nbytes


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """One segment file as :meth:`ShmSegment.list_segments` saw it.

    ``problem`` is the cold-start reason when the header is unusable; then the identity
    fields are None. ``valid_blocks`` counts entries flagged valid (checksums unverified).
    """

    path: str
    size: int
    problem: ColdStart | None
    server_name: str | None = None
    key: str | None = None
    model_id: str | None = None
    num_blocks: int | None = None
    block_nbytes: int | None = None
    valid_blocks: int = 0


def model_digest(model_id: str) -> bytes:
    """16-byte digest of a model identity string."""
    return xxhash.xxh3_128_digest(model_id.encode("utf-8"))


def payload_offset(num_blocks: int) -> int:
    """Page-aligned payload offset for ``num_blocks`` manifest entries."""
    end = HEADER_NBYTES + num_blocks * ENTRY_NBYTES
    return -(-end // PAGE) * PAGE


def make_header(
    *, num_blocks: int, block_nbytes: int, layout_digest: bytes, model_id: str, server_name: str, key: str
) -> Header:
    """The header a fresh segment with this identity and geometry gets."""
    return Header(
        num_blocks=num_blocks,
        block_nbytes=block_nbytes,
        layout_digest=layout_digest,
        manifest_offset=HEADER_NBYTES,
        payload_offset=payload_offset(num_blocks),
        payload_nbytes=num_blocks * block_nbytes,
        model_digest=model_digest(model_id),
        model_id=model_id,
        server_name=server_name,
        key=key,
    )


def pack_header(h: Header) -> bytes:
    """Serialize ``h`` (HEADER_NBYTES bytes, checksum filled in)."""
    mid, srv, key = (s.encode("utf-8") for s in (h.model_id, h.server_name, h.key))
    fields = (
        MAGIC,
        FORMAT_VERSION,
        HEADER_NBYTES,
        0,
        h.num_blocks,
        h.block_nbytes,
        h.layout_digest,
        h.manifest_offset,
        ENTRY_NBYTES,
        0,
        h.payload_offset,
        h.payload_nbytes,
        h.model_digest,
        len(mid),
        len(srv),
        len(key),
        0,
        mid,
        srv,
        key,
    )
    raw = bytearray(_HEADER.pack(*fields))
    struct.pack_into("<Q", raw, _CHECKSUM_AT, xxhash.xxh3_64_intdigest(bytes(raw)))
    return bytes(raw) + bytes(HEADER_NBYTES - len(raw))


def unpack_header(raw: bytes) -> Header | tuple[ColdStart, str]:
    """Decode and verify a header; on failure return ``(reason, detail)`` instead."""
    if len(raw) < _HEADER.size:
        return ColdStart.CORRUPT_HEADER, f"header truncated to {len(raw)} bytes"
    magic, version, hsize = _PREFIX.unpack_from(raw)
    if magic != MAGIC:
        return ColdStart.CORRUPT_HEADER, f"bad magic {magic!r}"
    if version != FORMAT_VERSION:
        return ColdStart.VERSION_MISMATCH, f"format version {version}, expected {FORMAT_VERSION}"
    f = _HEADER.unpack_from(raw)
    body = bytearray(raw[: _HEADER.size])
    body[_CHECKSUM_AT : _CHECKSUM_AT + 8] = bytes(8)
    if hsize != HEADER_NBYTES or f[3] != xxhash.xxh3_64_intdigest(bytes(body)):
        return ColdStart.CORRUPT_HEADER, "header checksum mismatch"
    try:
        h = Header(
            num_blocks=f[4],
            block_nbytes=f[5],
            layout_digest=f[6],
            manifest_offset=f[7],
            payload_offset=f[10],
            payload_nbytes=f[11],
            model_digest=f[12],
            model_id=f[17][: f[13]].decode("utf-8"),
            server_name=f[18][: f[14]].decode("utf-8"),
            key=f[19][: f[15]].decode("utf-8"),
        )
    except UnicodeDecodeError as exc:
        return ColdStart.CORRUPT_HEADER, f"undecodable name: {exc}"
    if (
        f[8] != ENTRY_NBYTES
        or h.manifest_offset != HEADER_NBYTES
        or (h.payload_offset != payload_offset(h.num_blocks) or h.payload_nbytes != h.num_blocks * h.block_nbytes)
    ):
        return ColdStart.CORRUPT_HEADER, "inconsistent region offsets"
    return h


def compare(found: Header, wanted: Header, file_nbytes: int) -> tuple[ColdStart, str] | None:
    """Why ``found`` (from a file of ``file_nbytes``) cannot be attached as ``wanted``; None if it can."""
    if found.model_id != wanted.model_id or found.model_digest != wanted.model_digest:
        return ColdStart.MODEL_MISMATCH, f"model_id {found.model_id!r} != {wanted.model_id!r}"
    geo: Callable[[Header], tuple[int, int, str]] = lambda h: (  # noqa: E731
        h.num_blocks,
        h.block_nbytes,
        h.layout_digest.hex(),
    )
    if geo(found) != geo(wanted):
        return ColdStart.GEOMETRY_MISMATCH, f"geometry {geo(found)} != {geo(wanted)}"
    if file_nbytes != found.file_nbytes:
        return ColdStart.SIZE_MISMATCH, f"file is {file_nbytes} bytes, header says {found.file_nbytes}"
    return None


def entry_checksum(seq: int, nbytes: int, key: bytes, payload: memoryview) -> int:
    """xxh3_64 over the entry's identifying fields then ``payload`` (the block's live bytes)."""
    h = xxhash.xxh3_64()
    h.update(_ENTRY_META.pack(seq, nbytes))
    h.update(_ENTRY_KEY.pack(len(key), key))
    h.update(payload)
    return h.intdigest()


def write_entry(buf: mmap.mmap, at: int, seq: int, nbytes: int, key: bytes, checksum: int) -> None:
    """Write every entry field except ``valid`` (which the caller must have cleared)."""
    buf[at : at + _VALID_AT] = (
        _ENTRY_META.pack(seq, nbytes) + struct.pack("<Q", checksum) + _ENTRY_KEY.pack(len(key), key)
    )


def set_valid(buf: mmap.mmap, at: int, valid: bool) -> None:
    """Write the entry's ``valid`` word (VALID_MAGIC or 0); a single aligned 4-byte store."""
    _VALID.pack_into(buf, at + _VALID_AT, VALID_MAGIC if valid else 0)


def inspect(path: str) -> SegmentInfo:
    """Parse one segment file (never raises on bad content)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            h = unpack_header(f.read(HEADER_NBYTES))
            if isinstance(h, tuple):
                return SegmentInfo(path=path, size=size, problem=h[0])
            if size != h.file_nbytes:
                return SegmentInfo(path=path, size=size, problem=ColdStart.SIZE_MISMATCH)
            f.seek(h.manifest_offset)
            manifest = f.read(h.num_blocks * ENTRY_NBYTES)
            if len(manifest) != h.num_blocks * ENTRY_NBYTES:
                return SegmentInfo(path=path, size=size, problem=ColdStart.SIZE_MISMATCH)
    except OSError:
        return SegmentInfo(path=path, size=0, problem=ColdStart.CORRUPT_HEADER)
    return SegmentInfo(
        path=path,
        size=size,
        problem=None,
        server_name=h.server_name,
        key=h.key,
        model_id=h.model_id,
        num_blocks=h.num_blocks,
        block_nbytes=h.block_nbytes,
        valid_blocks=sum(e.valid == VALID_MAGIC for e in read_entries(manifest)),
    )


def os_failure(exc: OSError, path: str, action: str, requested: int | None = None) -> Exception:
    """Translate an OSError on ``path`` into CapacityError (no room) or UsageError."""
    if exc.errno in NO_ROOM:
        used: int | None
        free: int | None
        try:
            st = os.statvfs(os.path.dirname(path) or ".")
            used, free = (st.f_blocks - st.f_bfree) * st.f_frsize, st.f_bavail * st.f_frsize
        except OSError:
            used = free = None
        return CapacityError(
            f"no room to {action} shm segment {path}: {exc.strerror}",
            requested=requested,
            used=used,
            free=free,
            path=path,
        )
    return UsageError(
        f"cannot {action} shm segment {path}: {exc.strerror}", argument="config.directory", path=path, errno=exc.errno
    )


def lock_or_refuse(fd: int, path: str) -> None:
    """flock(LOCK_EX | LOCK_NB) ``fd``; if another process holds it, close ``fd`` and raise UsageError."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UsageError(
            f"shm segment {path} is attached by another live process", argument="config.key", path=path
        ) from None


def open_locked(path: str) -> int:
    """Open (creating) ``path`` and lock it; retry if it was unlinked before we locked it."""
    for _ in range(8):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise os_failure(exc, path, "open") from exc
        lock_or_refuse(fd, path)
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)
    raise UsageError(f"shm segment {path} keeps being replaced while opening", argument="config.key")


def attach_problem(fd: int, wanted: Header) -> tuple[ColdStart, str] | None:
    """Why the file behind ``fd`` cannot be attached as ``wanted`` (None: it can)."""
    size = os.fstat(fd).st_size
    if size == 0:
        return ColdStart.NEW, "no segment yet"
    found = unpack_header(os.pread(fd, HEADER_NBYTES, 0))
    if isinstance(found, tuple):
        return found
    return compare(found, wanted, size)


def format_segment(fd: int, path: str, header: Header) -> None:
    """Zero-fill the file to its full size (no valid entries), then write the header last.

    The pages are reserved with posix_fallocate, so a file system without room fails here
    (CapacityError; the empty file is removed) instead of with SIGBUS on first touch.
    """
    os.ftruncate(fd, 0)
    try:
        os.posix_fallocate(fd, 0, header.file_nbytes)
    except OSError as exc:
        os.ftruncate(fd, 0)
        try:
            os.unlink(path)
        except OSError:
            pass
        raise os_failure(exc, path, "size", requested=header.file_nbytes) from exc
    os.pwrite(fd, pack_header(header), 0)
