"""The storage tier's write path: a batch of blocks becomes one durable, immutable segment file.

:class:`SegmentWriter` lays the records out (:mod:`tiersync.tiers.storage_format`), writes
the header area and the 4 KiB-aligned payloads under a temporary name (one ``pwritev``
pass, O_DIRECT when allowed and every view is aligned), fsyncs it, atomically renames it
and fsyncs the directory; only then is the segment published to the
:class:`~tiersync.tiers.storage_index.SegmentIndex` (older copies of its keys are
tombstoned). :func:`take_writes` decides how many queued write requests one segment packs.

Errors: a full disk (ENOSPC/EDQUOT) raises :class:`CapacityError`; a directory that
cannot be written (EACCES/EPERM/EROFS) raises :class:`UsageError` naming
``StorageConfig.directory``. Either way the temporary file is removed and the index is
unchanged.
"""

from __future__ import annotations

import errno
import itertools
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor

import xxhash

from tiersync.errors import CapacityError, UsageError
from tiersync.tiers import storage_format as fmt
from tiersync.tiers import storage_io as sio
from tiersync.tiers.storage_index import SegmentIndex, unlink_quiet

__all__ = ["SegmentWriter", "take_writes"]

_FULL = {errno.ENOSPC, errno.EDQUOT}
_DENIED = {errno.EACCES, errno.EPERM, errno.EROFS}


def take_writes(reqs: Sequence[tuple[object, Sequence[memoryview]]], segment_bytes: int) -> int:
    """How many write requests from the head of ``reqs`` one segment packs: at least one, then
    as many as keep the payload within ``segment_bytes``."""
    n, total = 0, 0
    for _, views in reqs:
        total += sum(len(v) for v in views)
        if n and total > segment_bytes:
            break
        n += 1
    return n


class SegmentWriter:
    """Writes segments of the cache ``identity`` into ``directory``, named
    ``<name_prefix><seq>.seg`` (see module docstring)."""

    def __init__(
        self,
        directory: str,
        identity: bytes,
        name_prefix: str,
        index: SegmentIndex,
        direct: sio.DirectIO,
        pool: Executor,
        *,
        direct_writes: bool,
        fsync: bool,
    ) -> None:
        self.directory, self._identity, self._name_prefix = directory, identity, name_prefix
        self._index, self._direct, self._pool = index, direct, pool
        self._direct_writes, self._fsync = direct_writes, fsync
        self._seq = itertools.count()

    def write(self, keys: list[bytes], views: list[memoryview]) -> None:
        """Write one segment of ``keys`` (``views`` their payloads), durable and indexed on return."""
        placed = fmt.layout_records(keys, [len(v) for v in views])
        seq = next(self._seq)
        name = f"{self._name_prefix}{seq:010d}{fmt.SUFFIX}"
        tmp = os.path.join(self.directory, fmt.TMP_PREFIX + name)
        nbytes = sum(len(v) for v in views)
        recs: list[fmt.Record] = []

        def header(sums: list[int]) -> bytes:
            recs[:] = [fmt.Record(k, off, n, c) for (k, off, n), c in zip(placed, sums)]
            return fmt.encode_header(self._identity, seq, time.time_ns(), recs)

        self._index.claim(name)  # before it is visible: a concurrent scan must not index it twice
        try:
            self._write_file(tmp, fmt.header_nbytes(len(keys)), header, views)
            os.rename(tmp, os.path.join(self.directory, name))
            if self._fsync:
                sio.fsync_dir(self.directory)
        except OSError as exc:
            unlink_quiet(tmp)
            raise self._translate(exc, nbytes) from exc
        self._index.bury(self._index.publish(name, recs, seq, nbytes))  # older copies: superseded

    def _write_file(
        self, path: str, header_nbytes: int, header: Callable[[list[int]], bytes], views: list[memoryview]
    ) -> None:
        direct = self._direct.on and self._direct_writes and all(sio.aligned(v) for v in views)
        used, _ = sio.write_file(
            path,
            header_nbytes,
            header,
            views,
            xxhash.xxh3_64_intdigest,
            direct=direct,
            fsync=self._fsync,
            pool=self._pool,
        )
        if direct and not used:
            self._direct.refused()

    def _translate(self, exc: OSError, nbytes: int) -> Exception:
        if exc.errno in _FULL:
            return CapacityError(
                "storage directory is full",
                requested=nbytes,
                free=_free_bytes(self.directory),
                directory=self.directory,
            )
        if exc.errno in _DENIED:
            return UsageError(
                "storage directory is not writable",
                argument="StorageConfig.directory",
                path=self.directory,
                error=exc.strerror,
            )
        return exc


def _free_bytes(path: str) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize
