"""Memory other processes of this host can map (tiersync.tiers.shareable): share_in_place,
share_all, check_shared, covering."""

from __future__ import annotations

import fcntl
import mmap
import os
import subprocess
import sys

import numpy as np
import pytest

from tiersync.errors import UsageError
from tiersync.tiers.huge_pages import HUGE_PAGE
from tiersync.tiers.shareable import NEEDED_SEALS, SharedRegion, check_shared, covering, share_all, share_in_place

PAGE = mmap.PAGESIZE

# Another process maps /proc/<pid>/fd/<fd> read-only, prints tsum-free facts about it, then
# prints what it sees at an offset each time it is asked (the owner writes in between).
_READER = """
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
os.close(fd)
base = int(sys.argv[3])  # the file offset of the region's first byte
print(len(m), m[base : base + int(sys.argv[2])].hex(), flush=True)
for line in sys.stdin:
    print(m[base + int(line)], flush=True)
"""


def _torch_like(nbytes: int, offset: int = 64) -> np.ndarray:
    """A buffer that starts ``offset`` bytes into a page, as torch's CPU allocator hands them
    out, in memory of its own (a fresh anonymous map: no page of it was ever shared)."""
    base = np.frombuffer(mmap.mmap(-1, nbytes + 2 * PAGE, flags=mmap.MAP_PRIVATE), np.uint8)
    return base[offset : offset + nbytes]


def test_share_in_place_backs_the_whole_pages_by_a_sealed_memfd_another_process_maps():
    """The buffer keeps its bytes and addresses; its whole pages (not the partial ones at
    either end) are now a sealed memfd that another process maps and sees the owner's later
    writes through: the buffer's memory is the file. Sealed: it cannot shrink or grow."""
    buf = _torch_like(40 * PAGE + 100)
    buf[:] = np.random.default_rng(3).integers(0, 256, buf.size, dtype=np.uint8)
    before, address = buf.copy(), buf.ctypes.data
    region = share_in_place(buf)
    try:
        assert isinstance(region, SharedRegion)
        assert region.address == -(-address // PAGE) * PAGE and region.address % PAGE == 0
        assert region.address + region.nbytes == (address + buf.size) // PAGE * PAGE
        assert region.offset == region.address % HUGE_PAGE  # congruent: huge pages stay possible
        assert buf.ctypes.data == address and np.array_equal(buf, before)
        assert fcntl.fcntl(region.fd, fcntl.F_GET_SEALS) & NEEDED_SEALS == NEEDED_SEALS
        with pytest.raises(OSError):
            os.ftruncate(region.fd, region.nbytes // 2)
        at = region.address - address  # the buffer's index of the region's first byte
        child = subprocess.Popen(
            [sys.executable, "-c", _READER, f"/proc/{os.getpid()}/fd/{region.fd}", "16", str(region.offset)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            size, head = child.stdout.readline().split()
            assert int(size) == region.offset + region.nbytes and bytes.fromhex(head) == buf[at : at + 16].tobytes()
            for i in (0, 5 * PAGE + 7, region.nbytes - 1):
                buf[at + i] = (int(buf[at + i]) + 1) % 256
                child.stdin.write(f"{i}\n")
                child.stdin.flush()
                assert int(child.stdout.readline()) == buf[at + i]
        finally:
            child.stdin.close()
            child.wait(30)
    finally:
        if region is not None:
            os.close(region.fd)
    buf[:] = 9  # the memory stays the process's once the descriptor is gone
    assert (buf == 9).all()


def test_a_large_buffer_is_shared_piece_by_piece_with_every_byte_kept(monkeypatch):
    """Pieces copied and mapped one after another (a small piece here: 5 of them and a
    partial one) keep every byte, each piece at its own offset."""
    from tiersync.tiers import shareable

    monkeypatch.setattr(shareable, "_PIECE", 3 * PAGE)
    buf = _torch_like(17 * PAGE)  # 64 bytes into a page: 16 whole pages
    buf[:] = np.random.default_rng(4).integers(0, 256, buf.size, dtype=np.uint8)
    before = buf.copy()
    region = share_in_place(buf)
    assert region is not None and region.nbytes == 16 * PAGE
    with open(f"/proc/self/fd/{region.fd}", "rb") as f:
        content = f.read()
    os.close(region.fd)
    at = region.address - buf.ctypes.data
    assert content[: region.offset] == bytes(region.offset)  # the file before the region: a hole
    assert np.array_equal(buf, before) and content[region.offset :] == buf[at : at + region.nbytes].tobytes()


def test_what_cannot_be_shared_is_left_alone_and_bad_buffers_are_refused():
    """No whole page inside: None, nothing changed. A read-only buffer, a non-contiguous one
    or no buffer at all: UsageError naming the argument."""
    small = _torch_like(PAGE, offset=64)  # spans two pages, covers neither
    small[:] = 5
    assert share_in_place(small) is None and (small == 5).all()
    readonly = np.zeros(4 * PAGE, np.uint8)
    readonly.flags.writeable = False
    for bad, reason in ((readonly, "writable"), (np.zeros((64, 64), np.uint8)[:, ::2], "contiguous"), (5, "buffer")):
        with pytest.raises(UsageError, match=reason) as exc:
            share_in_place(bad, "kv_caches[3]")
        assert exc.value.argument == "kv_caches[3]"


def test_share_all_shares_each_memory_once_and_checks_every_buffer_first():
    """Two views of one buffer are shared once; a bad item is refused, naming it, before
    anything is shared."""
    pool = _torch_like(32 * PAGE)
    pool[:] = 1
    other = _torch_like(8 * PAGE)
    with pytest.raises(UsageError) as exc:
        share_all([pool, b"read-only bytes"], "kv_caches")
    assert exc.value.argument == "kv_caches[1]"
    assert not _is_shared(pool)  # the first was not touched
    regions = share_all([pool, pool[: 16 * PAGE], other])  # the view lies in what pool shared
    try:
        assert len(regions) == 2 and _is_shared(pool) and _is_shared(other)
        assert regions[1].address == -(-other.ctypes.data // PAGE) * PAGE
    finally:
        for r in regions:
            os.close(r.fd)


def _is_shared(buf: np.ndarray) -> bool:
    """True when the page holding the buffer's middle is a shared map of a memfd (/proc/self/maps)."""
    middle = buf.ctypes.data + buf.size // 2
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= middle < hi:
                return perms.endswith("s") and "/memfd:tiersync" in line
    return False


def test_covering_names_the_region_holding_most_rows_and_check_shared_refuses_others():
    a, b = SharedRegion(10, 0x10000, 0x10000), SharedRegion(11, 0x40000, 0x10000)
    rows = np.array([[0x40000, 16, 0], [0x40100, 16, 0], [0x10000, 16, 0], [0x3FFF0, 32, 0]], np.uint64)
    assert covering((a, b), rows) == (11, 0x40000, 0x10000, 0)  # two rows inside b, one inside a
    assert covering((a,), rows[:1]) is None and covering((a, b), rows[:0]) is None
    assert covering((a, b), rows[3:]) is None  # straddles b's start: inside neither
    assert check_shared([a, b]) == (a, b)
    with pytest.raises(UsageError) as exc:
        check_shared([a, (1, 2, 3)])
    assert exc.value.argument == "shared"


def test_zeroed_pieces_are_not_copied_but_read_as_zeros_and_are_resident(monkeypatch):
    """A zeroed buffer (an engine's fresh KV cache) is shared without copying its zero pieces
    (no pwrite of them): it reads as zeros, a piece with one byte set keeps it, and every page
    is allocated, as the zeroed pages were (the owner's first writes do not fault)."""
    from tiersync.tiers import shareable

    monkeypatch.setattr(shareable, "_PIECE", 4 * PAGE)
    written: list[int] = []
    real = os.pwrite
    monkeypatch.setattr(shareable.os, "pwrite", lambda fd, data, at: written.append(at) or real(fd, data, at))
    buf = _torch_like(33 * PAGE)
    buf[:] = 0
    buf[-(5 * PAGE)] = 7  # one byte in the last whole piece
    region = shareable.share_in_place(buf)
    assert region is not None
    try:
        st = os.fstat(region.fd)
        piece = (buf.ctypes.data + buf.size - 5 * PAGE - region.address) // (4 * PAGE) * 4 * PAGE
        assert written == [region.offset + piece] and st.st_size == region.offset + 32 * PAGE  # one piece copied
        if st.st_blocks * 512 != 32 * PAGE:  # before Linux 5.14: allocated on first touch instead
            pytest.skip("no MADV_POPULATE_WRITE")
        assert buf[-(5 * PAGE)] == 7 and np.count_nonzero(buf) == 1
    finally:
        os.close(region.fd)


def test_memory_that_is_not_private_anonymous_is_left_alone():
    """A file's pages or memory already shared (an anonymous shared map, another memfd) are
    not remapped: their sharing with the file or the other process would silently end."""
    shared_anon = np.frombuffer(mmap.mmap(-1, 8 * PAGE), np.uint8)  # MAP_SHARED by default
    shared_anon[:] = 3
    assert share_in_place(shared_anon) is None and (shared_anon == 3).all()
    with open(f"/proc/self/fd/{os.memfd_create('file')}", "r+b") as f:
        f.truncate(8 * PAGE)
        private_file = np.frombuffer(mmap.mmap(f.fileno(), 8 * PAGE, flags=mmap.MAP_PRIVATE), np.uint8)
        assert share_in_place(private_file) is None


def test_shared_pages_can_still_be_collapsed_into_huge_pages():
    """The memfd offsets are congruent to the addresses modulo 2 MiB, so the kernel can back a
    shared buffer's aligned interior with huge pages as it could before (where it collapses
    private memory at all on this host)."""
    from tiersync.tiers.huge_pages import Collapser

    def collapsed(share: bool) -> int:
        buf = _torch_like(4 * HUGE_PAGE, offset=PAGE + 64)  # neither page- nor 2 MiB-aligned
        buf[:] = 1
        region = share_in_place(buf) if share else None
        c = Collapser([buf])
        c.done.wait(30)
        if region is not None:
            os.close(region.fd)
        assert (buf == 1).all()
        return c.collapsed

    if collapsed(share=False) == 0:
        pytest.skip("this host collapses no memory into huge pages")
    assert collapsed(share=True) > 0


def test_heap_memory_is_left_alone():
    """Memory of the brk heap (small allocations) is not remapped: the allocator hands its
    pages on to other objects once freed, which would then be shared pages."""
    buf = np.zeros(64 << 10, np.uint8)  # under malloc's mmap threshold: from the heap
    middle = buf.ctypes.data + buf.size // 2
    with open("/proc/self/maps") as maps:
        where = [
            line for line in maps if int(line.split("-")[0], 16) <= middle < int(line.split()[0].split("-")[1], 16)
        ]
    if not where or "[heap]" not in where[0]:
        pytest.skip("this allocation did not come from the brk heap")
    assert share_in_place(buf) is None
