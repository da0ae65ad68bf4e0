"""One read pass of the storage tier: every read request queued together, served in one go.

The pass resolves each key to its record under the index lock (then releases it),
groups the records by segment, sorts them by offset and cuts contiguous records into
*runs*, each filled by one ``preadv`` straight into the callers' views. With O_DIRECT
(aligned views; see :mod:`tiersync.tiers.storage_io` for the measurements) runs of
up to DIRECT_RUN_NBYTES go to the ``io`` executor, several in flight, across
segments. Buffered runs (up to BUFFERED_RUN_NBYTES) are read in order by the pass
thread, which lets the kernel's readahead stream and asks WILLNEED of the next
segment before starting one. Every block is checked against its record's xxh3_64 as
soon as its run is in (buffered: on the ``io`` executor, overlapping the next
``preadv``, which releases the GIL). A block whose length or checksum is wrong is
``CORRUPT`` and deleted (durably: never served, not even after a restart); one whose
file vanished is ``MISSING`` and forgotten; an I/O error is ``UNREADABLE`` (kept: it
may be transient).
"""

from __future__ import annotations

import enum
import errno
import os
from concurrent.futures import Executor, Future
from typing import TYPE_CHECKING

import xxhash

from tiersync.tiers import storage_io as sio
from tiersync.tiers.storage_format import Record

if TYPE_CHECKING:
    from tiersync.tiers.storage_index import SegmentIndex

DIRECT_RUN_NBYTES = 4 << 20  # the virtio disk's max request; 8 of them in flight measured best
BUFFERED_RUN_NBYTES = 32 << 20


class ReadStatus(enum.Enum):
    OK = "ok"
    MISSING = "missing"  # unknown key, or its file vanished
    CORRUPT = "corrupt"  # checksum or length mismatch: never served
    UNREADABLE = "unreadable"  # permission denied or another I/O error


_Item = tuple[int, int, Record]  # (request, index in it, record)


class _Segment:
    """One file of the pass: its records (``items``: (request, index, record)) and open fd."""

    def __init__(self, path: str, items: list[_Item], views: list[memoryview], direct: bool) -> None:
        self.path, self.items = path, items
        self.extents = [(r.offset, v) for (_, _, r), v in zip(items, views)]
        self.wanted_direct = direct and all(sio.aligned(v) for v in views)
        self.fd, self.direct = sio.open_for_read(path, self.wanted_direct)
        nbytes = DIRECT_RUN_NBYTES if self.direct else BUFFERED_RUN_NBYTES
        self.runs = sio.runs(self.extents, gaps=not self.direct, max_nbytes=nbytes)

    def span(self) -> tuple[str, int, int]:
        lo = min(o for o, _ in self.extents)
        return self.path, lo, max(o + len(v) for o, v in self.extents) - lo


class ReadPass:
    """Serve ``requests`` (``(keys, views)`` each) from the segments ``index`` knows in
    ``directory``; :meth:`run` gives their statuses. ``direct`` is the tier's O_DIRECT switch
    (turned off here when the file system refuses it); ``io`` runs the checksum checks."""

    def __init__(
        self,
        index: SegmentIndex,
        directory: str,
        direct: sio.DirectIO,
        requests: list[tuple[list[bytes], list[memoryview]]],
        io: Executor,
    ) -> None:
        self.index, self.directory, self.direct = index, directory, direct
        self.requests, self._io = requests, io
        self.out = [[ReadStatus.MISSING] * len(keys) for keys, _ in requests]
        self._segment_of: dict[tuple[int, int], str] = {}

    def run(self) -> list[list[ReadStatus]]:
        segments = self._open(self._resolve())
        try:
            pending: list[Future[list[int] | None]] = []
            for seg in segments:
                if seg.direct:
                    pending += [self._io.submit(self._read, seg, run) for run in seg.runs]
            buffered = [s for s in segments if not s.direct]
            for n, seg in enumerate(buffered):
                if n + 1 < len(buffered):
                    sio.prefetch_file(*buffered[n + 1].span())
                for run in seg.runs:
                    got = self._read(seg, run, verify=False)
                    if got is not None:
                        pending.append(self._io.submit(self._check, seg, run, got))
            for f in pending:
                f.result()
        finally:
            for seg in segments:
                os.close(seg.fd)
        self._finish()
        return self.out

    def _resolve(self) -> dict[str, list[_Item]]:
        plan: dict[str, list[_Item]] = {}
        with self.index.lock:
            for q, (keys, views) in enumerate(self.requests):
                for i, (k, v) in enumerate(zip(keys, views)):
                    loc = self.index.locs.get(k)
                    if loc is None:
                        continue
                    if len(v) != loc.record.length:  # rewritten at another size since read() checked: not
                        continue  # this reader's block (MISSING), kept for its writer
                    self._segment_of[(q, i)] = loc.segment
                    plan.setdefault(loc.segment, []).append((q, i, loc.record))
        return plan

    def _open(self, plan: dict[str, list[_Item]]) -> list[_Segment]:
        out = []
        for name in sorted(plan):
            items = plan[name]
            try:
                seg = _Segment(
                    os.path.join(self.directory, name),
                    items,
                    [self.requests[q][1][i] for q, i, _ in items],
                    self.direct.on,
                )
            except FileNotFoundError:
                continue  # MISSING
            except OSError:
                self._mark(items, ReadStatus.UNREADABLE)
                continue
            if seg.wanted_direct and not seg.direct:
                self.direct.refused()
            out.append(seg)
        return out

    def _read(self, seg: _Segment, run: list[int], verify: bool = True) -> list[int] | None:
        try:
            got = sio.read_run(seg.fd, seg.extents, run)
        except OSError as exc:
            if not (seg.direct and exc.errno == errno.EINVAL):
                self._mark([seg.items[j] for j in run], ReadStatus.UNREADABLE)
                return None
            self.direct.refused()
            try:
                fd = os.open(seg.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                try:
                    got = sio.read_run(fd, seg.extents, run)
                finally:
                    os.close(fd)
            except OSError:
                self._mark([seg.items[j] for j in run], ReadStatus.UNREADABLE)
                return None
        if verify:
            self._check(seg, run, got)
        return got

    def _check(self, seg: _Segment, run: list[int], got: list[int]) -> None:
        for j, n in zip(run, got):
            q, i, r = seg.items[j]
            ok = n == r.length and xxhash.xxh3_64_intdigest(seg.extents[j][1]) == r.checksum
            self.out[q][i] = ReadStatus.OK if ok else ReadStatus.CORRUPT

    def _mark(self, items: list[_Item], status: ReadStatus) -> None:
        for q, i, _ in items:
            self.out[q][i] = status

    def _finish(self) -> None:
        nbytes, corrupt, forget = 0, 0, []
        for q, (keys, views) in enumerate(self.requests):
            for i, st in enumerate(self.out[q]):
                if st is ReadStatus.OK:
                    nbytes += len(views[i])
                    continue
                corrupt += st is ReadStatus.CORRUPT
                if st is not ReadStatus.UNREADABLE and (q, i) in self._segment_of:
                    forget.append((keys[i], self._segment_of[(q, i)]))  # vanished or bad: for good
        index = self.index
        with index.lock:
            index.counts["bytes_read"] += nbytes
            index.counts["read_corrupt"] += corrupt
            dead = index.drop(forget)
        index.bury(dead)
