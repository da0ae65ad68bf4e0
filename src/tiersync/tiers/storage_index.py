"""What the storage tier's directory holds, by key: segment scans, and durable deletion.

:class:`SegmentIndex` maps each key to its record (segment, offset, length, checksum).
It is rebuilt by scanning segment headers (:meth:`scan`), is told about segments this
process wrote (:meth:`publish`), and forgets keys (:meth:`drop`, then :meth:`bury`
outside the lock): a segment none of whose records is live any more is unlinked, a
partly dead one gets its deleted records appended to its tombstone sidecar
(:mod:`tiersync.tiers.storage_format`), so no later scan — this process after a
restart, or another one — brings them back. A record shadowed by a newer one of the
same key is tombstoned the same way. The sidecar append is one small ``O_APPEND``
write (survives a SIGKILL at once); :meth:`sync_tombstones` fsyncs them (the tier calls
it before each segment write and on close, so a power loss can at worst bring back
blocks with their own verified bytes). ``lock`` guards the maps; no I/O under it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from tiersync.tiers import storage_format as fmt
from tiersync.tiers import storage_io as sio


@dataclass(frozen=True, slots=True)
class Loc:
    segment: str
    record: fmt.Record
    seq: int


Dead = tuple[list[str], dict[str, list[bytes]]]  # (segments to unlink, segment -> keys to tombstone)


class SegmentIndex:
    """Keys of one cache ``identity`` in ``directory`` (see module docstring)."""

    def __init__(self, directory: str, identity: bytes) -> None:
        self.directory, self.identity = directory, identity
        self.lock = threading.RLock()
        self.locs: dict[bytes, Loc] = {}
        self.live: dict[str, set[bytes]] = {}
        self.seen: set[str] = set()
        self.counts = dict(
            corrupt=0, truncated=0, foreign=0, unreadable=0, read_corrupt=0, bytes_written=0, bytes_read=0, deleted=0
        )
        self._dirty: set[str] = set()

    def claim(self, name: str) -> bool:
        """True the first time ``name`` is seen (then it is this caller's to scan)."""
        with self.lock:
            if name in self.seen:
                return False
            self.seen.add(name)
            return True

    def bump(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.counts[name] += n

    # -- scan ----------------------------------------------------------------
    def scan(self, name: str) -> list[bytes]:
        """Index the records of segment ``name`` not deleted and not known yet; returns their keys."""
        path = os.path.join(self.directory, name)
        try:
            buf, size = _read_header_area(path)
            deleted = _read_tombstones(path + fmt.TOMB_SUFFIX)
        except OSError:
            self.bump("unreadable")
            return []
        seg = fmt.parse_segment(buf, self.identity, size)
        records = [r for r in seg.records if r.key not in deleted]
        if seg.records and not records:  # every block deleted: finish the job
            unlink_segment(path)
        with self.lock:
            for k in ("corrupt", "truncated"):
                self.counts[k] += getattr(seg, k)
            self.counts["foreign"] += int(seg.foreign)
            self.counts["deleted"] += len(seg.records) - len(records)
            added = [r for r in records if r.key not in self.locs]
            shadowed = [r.key for r in records if r.key in self.locs]
            for r in added:
                self.locs[r.key] = Loc(name, r, seg.seq)
            if added:
                self.live[name] = {r.key for r in added}
        if shadowed:  # the same key in an older scan: one copy is enough, and deletes must hit all
            self.bury(([], {name: shadowed}))
        return [r.key for r in added]

    def publish(self, name: str, records: list[fmt.Record], seq: int, nbytes: int) -> Dead:
        """This process wrote segment ``name``: index it; older copies of its keys become dead."""
        with self.lock:
            self.seen.add(name)
            dead = self.drop(
                [(r.key, None) for r in records if r.key in self.locs and self.locs[r.key].segment != name]
            )
            for r in records:
                self.locs[r.key] = Loc(name, r, seq)
            self.live[name] = {r.key for r in records}
            self.counts["bytes_written"] += nbytes
            return dead

    # -- deletion ------------------------------------------------------------
    def drop(self, items: Sequence[tuple[bytes, str | None]]) -> Dead:
        """Under :attr:`lock`: forget each key (only while it is still in ``segment``, when given).
        Pass the result to :meth:`bury` once the lock is released."""
        dead: list[str] = []
        tombs: dict[str, list[bytes]] = {}
        for k, segment in items:
            loc = self.locs.get(k)
            if loc is None or (segment is not None and loc.segment != segment):
                continue
            del self.locs[k]
            live = self.live.get(loc.segment)
            if live is not None:
                live.discard(k)
                if not live:
                    del self.live[loc.segment]
                    dead.append(loc.segment)
                    continue
            tombs.setdefault(loc.segment, []).append(k)
        return dead, tombs

    def bury(self, dead: Dead) -> None:
        """Make a :meth:`drop` durable: unlink dead segments, tombstone the rest. Errors are ignored
        (e.g. a read-only directory: the blocks may come back, with their own verified bytes)."""
        segments, tombs = dead
        for name in segments:
            unlink_segment(os.path.join(self.directory, name))
        for name, keys in tombs.items():
            path = os.path.join(self.directory, name)
            if not os.path.exists(path):
                continue  # gone already: nothing to bring back
            try:
                sio.append_file(path + fmt.TOMB_SUFFIX, fmt.encode_tombstones(keys), fsync=False)
            except OSError:
                continue
            with self.lock:
                self._dirty.add(path + fmt.TOMB_SUFFIX)

    def sync_tombstones(self) -> None:
        """fsync the sidecars appended to since the last call."""
        with self.lock:
            paths, self._dirty = self._dirty, set()
        for p in paths:
            try:
                fd = os.open(p, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
            except OSError:
                pass
            finally:
                os.close(fd)


def _read_header_area(path: str) -> tuple[bytes, int]:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(fmt.HEAD_NBYTES)
        parsed = fmt.parse_head(head)
        count = fmt.header_records(parsed[0], size) if parsed else 0  # a damaged count never sizes a read
        return head + f.read(max(fmt.header_nbytes(count) - fmt.HEAD_NBYTES, 0)), size


def _read_tombstones(path: str) -> set[bytes]:
    try:
        with open(path, "rb") as f:
            return fmt.parse_tombstones(f.read())
    except FileNotFoundError:
        return set()


def unlink_segment(path: str) -> None:
    """The segment first, then its sidecar (a sidecar alone is an orphan, never a resurrection)."""
    unlink_quiet(path)
    unlink_quiet(path + fmt.TOMB_SUFFIX)


def unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
