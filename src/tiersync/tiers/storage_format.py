"""On-disk format of the storage tier: immutable segment files of block records.

A segment holds the blocks of one write batch::

    [segment header, 64 B][descriptor 0, 96 B]...[descriptor n-1] | pad to ALIGN
    [payload 0 | pad to ALIGN][payload 1 | pad]...

Segment header (little-endian): magic ``b"TSSEGMT1"``, version u32, record count
u32, cache-identity digest (16 B), writer sequence u64, creation time ns u64,
xxh3_64 of the header and all descriptors (with this field zero) u64, pad.

Descriptor = the per-record header: magic ``b"TREC"``, version u16, key length
u16, cache-identity digest (16 B), key (32 B, zero padded), payload offset u64,
payload length u64, xxh3_64 of the payload u64, xxh3_64 of this descriptor u64.

Payloads start on ``ALIGN`` (4096) boundaries so they can be read and written
with ``O_DIRECT``. A segment is written under a temporary name, fsynced, renamed
into place and the directory fsynced, so a visible segment is complete; what
can still go wrong (bit rot, truncation, a foreign writer) is caught by the
checksums: a descriptor or header that fails is skipped and counted at scan, a
payload is checksummed on every read and never served when it fails.

Deletions are durable through a *tombstone* sidecar ``<segment>.del`` beside a
segment that still has live blocks: appended 64-byte records (magic ``b"TDEL"``,
key length u16, pad u16, key 32 B, reserved 16 B, xxh3_64 of the first 56 bytes
u64), one ``write`` per delete call with ``O_APPEND`` (atomic on a local file
system), so a scan after a restart skips the records they name. A torn or
damaged tombstone fails its checksum and is ignored: the block then comes back
with its own verified bytes (never wrong ones); the records after it are still
found (a scan looks for each record's magic, not at fixed offsets). A segment
whose every record is tombstoned is unlinked, then its sidecar; a sidecar
without its segment is an orphan, removed on the next open.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

MAGIC = b"TSSEGMT1"
REC_MAGIC = b"TREC"
VERSION = 1
ALIGN = 4096
MAX_KEY_NBYTES = 32
SUFFIX = ".seg"
TOMB_SUFFIX = ".del"  # appended to a segment's name: its tombstone sidecar
TMP_PREFIX = ".tmp-"
TOMB_MAGIC = b"TDEL"

_HEAD = struct.Struct("<8sII16sQQQ")  # 56 B, padded to 64
HEAD_NBYTES = 64
_DESC = struct.Struct("<4sHH16s32sQQQQ")  # 88 B, padded to 96
DESC_NBYTES = 96
_TOMB = struct.Struct("<4sHH32s16s")  # 56 B + xxh3_64 = 64
TOMB_NBYTES = 64


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True, slots=True)
class Record:
    """Where one block's bytes are inside a segment."""

    key: bytes
    offset: int
    length: int
    checksum: int


@dataclass(frozen=True, slots=True)
class ParsedSegment:
    """Result of parsing a segment's header area: good records and counts of bad ones."""

    records: tuple[Record, ...]
    seq: int
    corrupt: int
    truncated: int
    foreign: bool = False
    unreadable: bool = False


def header_nbytes(count: int) -> int:
    return align_up(HEAD_NBYTES + DESC_NBYTES * count)


def layout_records(keys: list[bytes], lengths: list[int]) -> list[tuple[bytes, int, int]]:
    """(key, offset, length) for a batch, payloads aligned after the header area."""
    off = header_nbytes(len(keys))
    out = []
    for k, n in zip(keys, lengths):
        out.append((k, off, n))
        off += align_up(n)
    return out


def encode_header(identity: bytes, seq: int, created_ns: int, records: list[Record]) -> bytes:
    """The header area (padded to ALIGN) for ``records``."""
    descs = b"".join(_encode_desc(identity, r) for r in records)
    head = _HEAD.pack(MAGIC, VERSION, len(records), identity, seq, created_ns, 0)
    body = head.ljust(HEAD_NBYTES, b"\0") + descs
    check = xxhash.xxh3_64_intdigest(body)
    head = _HEAD.pack(MAGIC, VERSION, len(records), identity, seq, created_ns, check)
    return (head.ljust(HEAD_NBYTES, b"\0") + descs).ljust(header_nbytes(len(records)), b"\0")


def _encode_desc(identity: bytes, r: Record) -> bytes:
    fields = (
        REC_MAGIC,
        VERSION,
        len(r.key),
        identity,
        r.key.ljust(MAX_KEY_NBYTES, b"\0"),
        r.offset,
        r.length,
        r.checksum,
    )
    check = xxhash.xxh3_64_intdigest(_DESC.pack(*fields, 0))
    return _DESC.pack(*fields, check).ljust(DESC_NBYTES, b"\0")


def parse_head(buf: bytes) -> tuple[int, bytes, int] | None:
    """(count, identity, seq) of a segment header, or None if it is not one."""
    if len(buf) < HEAD_NBYTES:
        return None
    magic, version, count, identity, seq, _created, _check = _HEAD.unpack_from(buf)
    if magic != MAGIC or version != VERSION:
        return None
    return count, identity, seq


def header_records(count: int, file_size: int) -> int:
    """How many descriptors to read for a header counting ``count`` in a file of ``file_size``
    bytes: ``count`` when its header area fits in the file, else (a damaged count, never
    trusted to size a read) the most a complete file of that size can hold (each record has
    a descriptor and at least ALIGN bytes of payload)."""
    if header_nbytes(count) <= file_size:
        return count
    return max(file_size - HEAD_NBYTES, 0) // (DESC_NBYTES + ALIGN)


def parse_segment(buf: bytes, identity: bytes, file_size: int) -> ParsedSegment:
    """Validate a segment's header area ``buf`` (the :func:`header_records` descriptors). A
    count whose header area does not fit in the file is a damaged header (one corrupt): its
    records are found by their own checksums, up to the first descriptor that fails."""
    head = parse_head(buf)
    if head is None:
        return ParsedSegment((), 0, corrupt=1, truncated=0)
    count, ident, seq = head
    if ident != identity:
        return ParsedSegment((), seq, 0, 0, foreign=True)
    n = header_records(count, file_size)
    damaged = n != count
    if len(buf) < HEAD_NBYTES + DESC_NBYTES * n:
        return ParsedSegment((), seq, corrupt=0, truncated=max(count, 1))
    # Each descriptor carries its own checksum, so a damaged segment header only costs
    # the records it no longer counts; the whole-area checksum is informational.
    records, corrupt, truncated = [], int(damaged), 0
    for i in range(n):
        rec = _decode_desc(buf[HEAD_NBYTES + i * DESC_NBYTES : HEAD_NBYTES + (i + 1) * DESC_NBYTES], identity)
        if rec is None and damaged:
            break
        if rec is None:
            corrupt += 1
        elif rec.offset + rec.length > file_size:
            truncated += 1
        else:
            records.append(rec)
    return ParsedSegment(tuple(records), seq, corrupt, truncated)


def _decode_desc(raw: bytes, identity: bytes) -> Record | None:
    magic, version, klen, ident, key, off, length, csum, check = _DESC.unpack_from(raw)
    if magic != REC_MAGIC or version != VERSION or ident != identity or not 0 < klen <= MAX_KEY_NBYTES:
        return None
    if xxhash.xxh3_64_intdigest(_DESC.pack(magic, version, klen, ident, key, off, length, csum, 0)) != check:
        return None
    if off % ALIGN:
        return None
    return Record(key[:klen], off, length, csum)


def encode_tombstones(keys: list[bytes]) -> bytes:
    """Tombstone records naming ``keys`` (each 1..MAX_KEY_NBYTES bytes)."""
    out = []
    for k in keys:
        body = _TOMB.pack(TOMB_MAGIC, len(k), 0, k.ljust(MAX_KEY_NBYTES, b"\0"), bytes(16))
        out.append(body + xxhash.xxh3_64_intdigest(body).to_bytes(8, "little"))
    return b"".join(out)


def parse_tombstones(buf: bytes) -> set[bytes]:
    """Keys named by the valid tombstone records of a sidecar; bad or partial records are skipped.

    Records are found by their magic wherever they start, not only at multiples of
    TOMB_NBYTES: a torn record (or junk) must not misalign, and so hide, the ones appended
    after it."""
    keys = set()
    off = buf.find(TOMB_MAGIC)
    while 0 <= off <= len(buf) - TOMB_NBYTES:
        rec = buf[off : off + TOMB_NBYTES]
        _magic, klen, _pad, key, _res = _TOMB.unpack_from(rec)
        ok = 0 < klen <= MAX_KEY_NBYTES and xxhash.xxh3_64_intdigest(rec[: _TOMB.size]) == int.from_bytes(
            rec[_TOMB.size :], "little"
        )
        if ok:
            keys.add(key[:klen])
        off = buf.find(TOMB_MAGIC, off + (TOMB_NBYTES if ok else 1))
    return keys
