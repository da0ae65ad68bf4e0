"""Same-host reads (``tiersync.net.local``, ``tiersync.net.samehost``) out of a real other process.

Invariants: every byte a verified read reports landed equals the source's, on any number of
threads and for any range sizes (the per-range checksum is tsum64 of exactly those bytes,
however the range was cut across threads); a range whose checksum does not match is refused
naming the region; a read the kernel refuses raises LocalReadError (never a partial success);
through a channel on route LOCAL, pull_many lands every block byte-exact across several
PULL_LOCAL groups, and a source that lies about a checksum is refused.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from _samehost_source import NBYTES, _expected, _ranges
from tiersync.errors import UsageError
from tiersync.net import events as ev
from tiersync.net import local
from tiersync.net import store_ops as so
from tiersync.net.errors import ProtocolError, ProtocolFault
from tiersync.net.frames import PayloadChecksum, payload_checksum
from tiersync.net.samehost import local_copy, local_copy_at
from tiersync.net.shared_maps import SharedMaps
from tiersync.net.source import MemoryBlockSource
from tiersync.net.tcp import Route, TcpConfig, TcpTransport
from tiersync.transfer.kernel import TSUM64, tsum64

pytestmark = pytest.mark.skipif(
    TSUM64 is None or not local.can_read(os.getpid()), reason="needs the native checksum and process_vm_readv"
)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_read_summed_lands_every_byte_and_sums_each_range(source, threads):
    pid, address = source
    want = _expected()
    ranges = _ranges(address)
    dests = [memoryview(bytearray(n)) for _, n in ranges]
    sums = local.read_summed(pid, ranges, dests, threads)
    for (addr, n), dest, got in zip(ranges, dests, sums):
        off = addr - address
        assert bytes(dest) == want[off : off + n].tobytes()
        assert got == tsum64(dest)


@pytest.mark.parametrize("threads", [1, 3])
def test_read_summed_at_lands_each_range_at_its_offset_in_one_array(source, threads):
    """The array form lands the same bytes with the same sums as one buffer per range, in any
    order of offsets, and refuses (UsageError naming ``offsets``, nothing read) a range that
    would not fit; local_copy_at verifies like local_copy."""
    pid, address = source
    want, ranges = _expected(), _ranges(address)
    sizes = np.array([n for _, n in ranges], np.int64)
    offsets = (np.cumsum(sizes) - sizes)[::-1].copy() + 3  # reversed: ranges land out of order
    ranges_rev = np.array(ranges[::-1], np.uint64)
    dest = np.zeros(int(sizes.sum()) + 3, np.uint8)
    sums = local.read_summed_at(pid, ranges_rev, dest, offsets, threads)
    for (addr, n), off, got in zip(ranges_rev.tolist(), offsets.tolist(), sums):
        assert dest[off : off + n].tobytes() == want[addr - address : addr - address + n].tobytes()
        assert got == tsum64(dest[off : off + n])
    dest[:] = 0
    with pytest.raises(UsageError) as exc:
        local.read_summed_at(pid, ranges_rev, dest[:-1], offsets, threads)
    assert exc.value.argument == "offsets" and not dest.any()  # refused before anything is read
    with pytest.raises(UsageError):  # a length past every buffer (a wrapped sum would fit)
        local.read_summed_at(pid, np.array([[address, 2**64 - 1]], np.uint64), dest, np.ones(1, np.uint64), threads)
    regions = np.concatenate([ranges_rev, np.array(sums, np.uint64)[:, None]], axis=1)
    local_copy_at(ev.LocalReply(1, pid, PayloadChecksum.TSUM64, regions), dest, offsets, "peer", threads)
    regions[2, 2] ^= np.uint64(1)
    with pytest.raises(ProtocolError) as err:
        local_copy_at(ev.LocalReply(1, pid, PayloadChecksum.TSUM64, regions), dest, offsets, "peer", threads)
    assert err.value.fault is ProtocolFault.BAD_CHECKSUM and "region=2" in str(err.value)
    xxh = PayloadChecksum.XXH3_64  # another algorithm: one view per region, copied then summed
    regions[:, 2] = [payload_checksum(xxh, dest[o : o + n]) for o, n in zip(offsets.tolist(), regions[:, 1].tolist())]
    dest[offsets[0] :] = 0
    local_copy_at(ev.LocalReply(1, pid, xxh, regions), dest, offsets, "peer", threads)
    assert dest[offsets[0] :].tobytes() == want[ranges_rev[0, 0] - address :][: int(sizes[-1])].tobytes()


def test_sum_ranges_equals_tsum64_and_refuses_ranges_outside():
    buf = _expected()
    offsets, lengths = [0, 1, 5, 100, 7, 1 << 20], [0, 1, 63, 64, (3 << 20) + 5, (20 << 20) + 1]
    for threads in (1, 3):
        assert local.sum_ranges(buf, offsets, lengths, threads) == [
            tsum64(buf[o : o + n]) for o, n in zip(offsets, lengths)
        ]
    with pytest.raises(ValueError):
        local.sum_ranges(buf, [NBYTES], [1])


def test_sum_ranges_states_are_each_ranges_partial_state_and_compose():
    from tiersync.transfer import kernel

    buf = _expected()
    offsets, lengths = [0, 64, 5, 1 << 20], [0, (1 << 20) - 64, 63, (3 << 20) + 5]  # pieces, tails, empty
    for threads in (1, 3):
        states = np.zeros((len(offsets), kernel.PARTIAL_BYTES // 8), np.uint64)
        sums = local.sum_ranges(buf, offsets, lengths, threads, states)
        assert sums == [tsum64(buf[o : o + n]) for o, n in zip(offsets, lengths)]
        assert [s.tobytes() for s in states] == [
            kernel.tsum64_partial(buf[o : o + n]) for o, n in zip(offsets, lengths)
        ]
        # [64, 1 MiB) then [1 MiB, 4 MiB + 5): their states compose into the run's checksum
        assert kernel.tsum64_compose([states[1].tobytes(), states[3].tobytes()]) == tsum64(buf[64 : (4 << 20) + 5])
    with pytest.raises(ValueError, match="states"):
        local.sum_ranges(buf, offsets, lengths, 1, np.zeros(17, np.uint64))  # not 17 per range


def test_refused_reads_raise_local_read_error(source):
    pid, _ = source
    with pytest.raises(local.LocalReadError, match="Bad address"):
        local.read_summed(pid, [(8, 100)], [memoryview(bytearray(100))], 2)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with pytest.raises(local.LocalReadError):
        local.read_summed(dead.pid, [(8, 100)], [memoryview(bytearray(100))], 1)


def test_local_copy_refuses_a_wrong_checksum_naming_the_region(source):
    pid, address = source
    ranges = _ranges(address)
    dests = [memoryview(bytearray(n)) for _, n in ranges]
    sums = local.read_summed(pid, ranges, dests, 1)
    regions = [(a, n, s) for (a, n), s in zip(ranges, sums)]
    local_copy(ev.LocalReply(1, pid, PayloadChecksum.TSUM64, tuple(regions)), dests, "peer", threads=2)
    regions[4] = (regions[4][0], regions[4][1], regions[4][2] ^ 1)
    with pytest.raises(ProtocolError) as exc:
        local_copy(ev.LocalReply(1, pid, PayloadChecksum.TSUM64, tuple(regions)), dests, "peer", threads=2)
    assert exc.value.fault is ProtocolFault.BAD_CHECKSUM and "region=4" in str(exc.value)
    with pytest.raises(ProtocolError) as exc:  # a reply that does not describe the request
        local_copy(ev.LocalReply(1, pid, PayloadChecksum.TSUM64, tuple(regions[:-1])), dests, "peer")
    assert exc.value.fault is ProtocolFault.MALFORMED


class LyingSource(MemoryBlockSource):
    """Serves the truth except one key, whose LOCAL_REPLY checksum is off by one bit."""

    LIE = b"\xee" * 16

    def handle(self, session, event):
        answers = super().handle(session, event)
        if isinstance(event, so.PullLocal) and any(k == self.LIE for k, _, _ in event.items):
            reply = answers[0]
            regions = reply.regions.copy()
            lie = [k == self.LIE for k, _, _ in event.items]
            regions[lie, 2] ^= np.uint64(1)
            return [ev.LocalReply(reply.request_id, reply.pid, reply.algo, regions)]
        return answers


def test_pull_many_on_route_local_spans_groups_and_refuses_a_lie():
    rng = np.random.default_rng(3)
    blocks = {
        i.to_bytes(16, "little"): rng.bytes(64 << 10) for i in range(700)
    }  # 44 MiB: PULL_LOCAL groups of 2, 4, 8, 16 MiB, then the rest
    blocks[LyingSource.LIE] = rng.bytes(4096)
    transport = TcpTransport(TcpConfig(route=Route.LOCAL, local_threads=2))
    server = transport.serve("127.0.0.1:0", LyingSource(blocks))
    channel = transport.connect(server.address)
    try:
        assert channel.info.same_host
        keys = [k for k in blocks if k != LyingSource.LIE]
        lease = channel.request(so.ReadLease(channel.new_request_id(), tuple(blocks), ttl_s=60)).lease_id
        dests = [memoryview(bytearray(len(blocks[k]))) for k in keys]
        channel.pull_many(lease, [(k, 0, d) for k, d in zip(keys, dests)])
        assert all(bytes(d) == blocks[k] for k, d in zip(keys, dests))
        with pytest.raises(ProtocolError) as exc:
            channel.pull_many(lease, [(LyingSource.LIE, 0, memoryview(bytearray(4096)))])
        assert exc.value.fault is ProtocolFault.BAD_CHECKSUM
    finally:
        channel.close()
        server.close()


def test_memory_block_source_regions_keep_whole_blocks_rows_and_refuse_as_views_do(monkeypatch):
    """A MemoryBlockSource answers ``regions`` of whole blocks from rows kept with their
    checksums (from the second read on, without ``views``), parts of blocks as the base does:
    the same rows the base derives from ``views`` either way, and the same refusals."""
    from tiersync.net.source import BlockError, BlockService

    rng = np.random.default_rng(4)
    blocks = {i.to_bytes(16, "little"): rng.bytes(4096 + 64 * i) for i in range(5)}
    keys = list(blocks)
    src = MemoryBlockSource(blocks)
    lease = src.lease(so.ReadLease(1, tuple(keys[:4]))).lease_id
    whole = [(k, 0, len(blocks[k])) for k in keys[:4]]
    for items in (whole, whole, [*whole[:2], (keys[3], 64, 100)], [(keys[1], 0, 100)]):
        got = src.regions(lease, items)
        assert np.array_equal(got, BlockService.regions(src, lease, items))
        assert got[:, 1].tolist() == [n for _, _, n in items]
    expected = BlockService.regions(src, lease, whole)
    with monkeypatch.context() as m:
        m.setattr(src, "views", lambda *a: pytest.fail("whole blocks read through views"))
        assert np.array_equal(src.regions(lease, whole), expected)
    for bad, code in (([whole[0], (keys[4], 0, 4352)], "NOT_FOUND"), ([(keys[0], 4000, 97)], "BAD_REQUEST")):
        with pytest.raises(BlockError) as info:
            src.regions(lease, bad)
        assert info.value.code is ev.ErrorCode[code]
    src.release(lease)
    with pytest.raises(BlockError) as info:
        src.regions(lease, whole)
    assert info.value.code is ev.ErrorCode.LEASE_EXPIRED


# -- shareable memory: mapped instead of process_vm_readv ------------------------------------------
_SHARING_CHILD = """
import json, os, sys, tempfile, numpy as np
from tiersync.tiers.host import HostArena, HostArenaConfig
n = int(sys.argv[1])
arena = HostArena(HostArenaConfig(num_blocks=n >> 20, block_nbytes=1 << 20, shareable=True))
arena.memory.reshape(-1)[:] = np.random.default_rng(9).integers(0, 256, n, dtype=np.uint8)
unsealed = os.memfd_create("unsealed")
os.ftruncate(unsealed, n)
plain = tempfile.TemporaryFile()
plain.truncate(n)
fifo_path = tempfile.mktemp()
os.mkfifo(fifo_path)
fifo = os.open(fifo_path, os.O_RDWR)  # a FIFO: opening it for reading alone would block
try:
    huge = os.memfd_create("huge", os.MFD_HUGETLB | os.MFD_ALLOW_SEALING)
    os.ftruncate(huge, 2 << 20)
    import fcntl
    fcntl.fcntl(huge, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
except OSError:
    huge = -1
print(json.dumps([arena.shared.fd, arena.address, unsealed, plain.fileno(), fifo, huge]), flush=True)
sys.stdin.read()
"""


@pytest.fixture(scope="module")
def sharing():
    """(pid, shared fd, address, unsealed memfd fd, regular file fd, FIFO fd, sealed hugetlbfs
    memfd fd or -1) of another process whose NBYTES seeded bytes (seed 9) lie in a shareable
    host arena."""
    import json

    child = subprocess.Popen(
        [sys.executable, "-c", _SHARING_CHILD, str(NBYTES)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        fd, address, unsealed, plain, fifo, huge = json.loads(child.stdout.readline())
        yield child.pid, fd, address, unsealed, plain, fifo, huge
    finally:
        child.stdin.close()
        child.wait(30)


def _shared_expected() -> np.ndarray:
    return np.random.default_rng(9).integers(0, 256, NBYTES, dtype=np.uint8)


@pytest.mark.parametrize("threads", [1, 3])
def test_a_mapped_read_lands_the_bytes_process_vm_readv_would(sharing, threads):
    """Out of a map of the other process's sealed memfd, read_summed and read_summed_at land
    the same bytes with the same per-range sums as the kernel's copy; a range outside the
    mapping is refused before anything is copied."""
    pid, fd, address, *_ = sharing
    maps = SharedMaps()
    mapped = maps.map(pid, (fd, address, NBYTES, 0))
    assert mapped is not None and maps.map(pid, (fd, address, NBYTES, 0))[0].obj is mapped[0].obj  # kept, not reopened
    want, ranges = _shared_expected(), _ranges(address)
    dests = [memoryview(bytearray(n)) for _, n in ranges]
    sums = local.read_summed(pid, ranges, dests, threads, mapped)
    kernel_dests = [memoryview(bytearray(n)) for _, n in ranges]
    assert list(sums) == list(local.read_summed(pid, ranges, kernel_dests, threads))
    for (addr, n), dest, other in zip(ranges, dests, kernel_dests):
        assert bytes(dest) == want[addr - address : addr - address + n].tobytes() == bytes(other)
    offsets = np.cumsum([0] + [n for _, n in ranges[:-1]]).astype(np.uint64)
    dest = np.zeros(sum(n for _, n in ranges), np.uint8)
    assert list(local.read_summed_at(pid, np.array(ranges, np.uint64), dest, offsets, threads, mapped)) == list(sums)
    assert dest.tobytes() == b"".join(bytes(d) for d in dests)
    for shift in (0, 1, 32):  # destinations aligned for streamed stores, and not
        aligned = np.zeros(dest.size + 4096, np.uint8)[shift:]  # page-aligned allocation, then shifted
        places = (np.cumsum([0] + [(n + 63) // 64 * 64 for _, n in ranges[:-1]])).astype(np.uint64)
        got = local.read_summed_at(pid, np.array(ranges, np.uint64), aligned, places, threads, mapped)
        assert list(got) == list(sums)
        assert all(aligned[p : p + n].tobytes() == bytes(d) for p, (_, n), d in zip(places.tolist(), ranges, dests))
    outside = [(address + NBYTES - 10, 11)]
    target = memoryview(bytearray(11))
    with pytest.raises(UsageError):
        local.read_summed(pid, outside, [target], threads, mapped)
    assert not any(target)
    maps.close()


def test_shared_maps_refuse_what_a_reader_could_fault_on_or_hang_on(sharing, monkeypatch):
    """Only a sealed memfd of normal pages at least as long as the region named is mapped: an
    unsealed memfd (it could shrink under the reader: SIGBUS), a regular file, a FIFO (opening
    it could block), a hugetlbfs memfd (its pool can run dry under a map), a descriptor that
    is not open, and a region longer than the file are refused (None: the caller uses
    process_vm_readv). A refused file is not opened again; a map is opened once."""
    from tiersync.net import shared_maps

    pid, fd, address, unsealed, plain, fifo, huge = sharing
    opened = []
    real = shared_maps._open_sealed
    monkeypatch.setattr(shared_maps, "_open_sealed", lambda *a: opened.append(a[0]) or real(*a))
    maps = SharedMaps()
    for bad in (unsealed, plain, fifo, 1 << 20) + ((huge,) if huge >= 0 else ()):
        assert maps.map(pid, (bad, address, NBYTES, 0)) is None
    assert f"/proc/{pid}/fd/{fifo}" not in opened  # not a regular file: never opened
    assert maps.map(pid, (fd, address, NBYTES + 1, 0)) is None
    before = len(opened)
    assert maps.map(pid, (unsealed, address, NBYTES, 0)) is None and len(opened) == before  # remembered
    assert maps.map(pid, (fd, address, NBYTES, 0)) is not None
    assert maps.map(pid, (fd, address, NBYTES, 0)) is not None and len(opened) == before  # kept
    maps.close()


def test_a_map_outlives_close_while_a_copy_holds_it_and_a_reused_descriptor_drops_it():
    """A view :meth:`SharedMaps.map` handed out stays readable after close (the copy using it
    finishes; the map goes with the view), nothing is mapped after close, and a descriptor
    number that now names another memfd drops the old file's map instead of keeping it."""
    from tiersync.tiers.shareable import open_shareable

    fd, owner = open_shareable(1 << 20)
    owner[:5] = b"first"
    maps = SharedMaps()
    view, address = maps.map(os.getpid(), (fd, 4096, 1 << 20, 0))
    assert address == 4096 and bytes(view[:5]) == b"first" and len(maps) == 1
    maps.close()
    assert bytes(view[:5]) == b"first" and maps.map(os.getpid(), (fd, 4096, 1 << 20, 0)) is None
    view.release()
    owner.close()
    os.close(fd)
    maps = SharedMaps()
    fd1, first = open_shareable(1 << 20)
    assert maps.map(os.getpid(), (fd1, 0, 1 << 20, 0)) is not None
    first.close()
    os.close(fd1)
    fd2, second = open_shareable(1 << 20)  # the lowest free descriptor: the same number
    second[:6] = b"second"
    if fd2 == fd1:
        view, _ = maps.map(os.getpid(), (fd2, 0, 1 << 20, 0))
        assert bytes(view[:6]) == b"second" and len(maps) == 1
        view.release()
    maps.close()
    second.close()
    os.close(fd2)


def test_local_copy_through_a_mapping_verifies_and_falls_back(sharing):
    """local_copy with a reply naming a mapping copies through it, verified: a mapping whose
    address is off (the bytes read are not the ones summed) is refused BAD_CHECKSUM, and a
    mapping that cannot be opened falls back to process_vm_readv with the same result. A
    mapping that holds only some regions (an engine's KV tensor shares its whole pages, not
    the partial ones at its ends) has those copied out of it and the others with
    process_vm_readv, all verified, in whatever order they come; a mapping whose file offset
    is off is refused BAD_CHECKSUM; a region that wraps around is refused MALFORMED."""
    pid, fd, address, unsealed, *_ = sharing
    want, ranges = _shared_expected(), _ranges(address)
    sums = [tsum64(want[a - address : a - address + n]) for a, n in ranges]
    regions = tuple((a, n, s) for (a, n), s in zip(ranges, sums))
    maps = SharedMaps()
    for mapping in ((fd, address, NBYTES, 0), (unsealed, address, NBYTES, 0)):
        dests = [memoryview(bytearray(n)) for _, n in ranges]
        local_copy(ev.LocalReply(1, pid, PayloadChecksum.TSUM64, regions, mapping), dests, "peer", 2, maps)
        assert all(bytes(d) == want[a - address : a - address + n].tobytes() for (a, n), d in zip(ranges, dests))
    dests = [memoryview(bytearray(n)) for _, n in ranges]
    with pytest.raises(ProtocolError) as exc:  # the map stands for addresses 64 bytes off: other bytes
        local_copy(
            ev.LocalReply(1, pid, PayloadChecksum.TSUM64, regions, (fd, address - 64, NBYTES, 0)), dests, "p", 2, maps
        )
    assert exc.value.fault is ProtocolFault.BAD_CHECKSUM
    # a mapping from file offset 4096 on, 1 MiB: regions 6-8 lie inside it, 0-5 and 9-10 do not;
    # the regions in a shuffled order, so those inside and those outside alternate
    order = [9, 6, 0, 7, 3, 10, 8, 1, 5, 2, 4]
    mixed, where = tuple(regions[i] for i in order), [ranges[i] for i in order]
    part = (fd, address + 4096, 1 << 20, 4096)
    assert [i for i in order if address + 4096 <= ranges[i][0] and sum(ranges[i]) <= address + 4096 + (1 << 20)] == [
        6,
        7,
        8,
    ]
    for copy in (local_copy, _copy_at):
        dests = [memoryview(bytearray(n)) for _, n in where]
        copy(ev.LocalReply(1, pid, PayloadChecksum.TSUM64, mixed, part), dests, "p", 2, maps)
        assert all(bytes(d) == want[a - address : a - address + n].tobytes() for (a, n), d in zip(where, dests))
        with pytest.raises(ProtocolError) as exc:  # an offset 64 bytes off: the regions inside did come out of it
            copy(ev.LocalReply(1, pid, PayloadChecksum.TSUM64, mixed, (*part[:3], 4096 - 64)), dests, "p", 2, maps)
        assert exc.value.fault is ProtocolFault.BAD_CHECKSUM and order[exc.value.context["region"]] in (6, 7, 8)
    part = (fd, address, 1 << 20, 0)
    wraps = ((address, 64, 0), ((1 << 64) - 8, 64, 0))
    with pytest.raises(ProtocolError, match="wraps") as exc:
        copy = [memoryview(bytearray(64)) for _ in wraps]
        local_copy(ev.LocalReply(1, pid, PayloadChecksum.TSUM64, wraps, part), copy, "p", 2, maps)
    assert exc.value.fault is ProtocolFault.MALFORMED
    maps.close()


def _copy_at(reply: ev.LocalReply, dests: list[memoryview], peer: str, threads: int, maps: SharedMaps) -> None:
    """local_copy_at into one array, then each region's bytes handed back into ``dests``."""
    lengths = [len(d) for d in dests]
    offsets = np.cumsum([0, *lengths[:-1]]).astype(np.uint64)
    dest = np.zeros(sum(lengths), np.uint8)
    try:
        local_copy_at(reply, dest, offsets, peer, threads, maps)
    finally:
        for d, o, n in zip(dests, offsets.tolist(), lengths):
            d[:] = dest[o : o + n].tobytes()


@pytest.mark.parametrize("local_maps", [True, False])
def test_a_block_source_over_a_shareable_arena_is_read_through_a_map(local_maps):
    """A MemoryBlockSource told where its shareable arena is names it in LOCAL_REPLY; a channel
    maps it (``local_maps``, the default) or keeps to process_vm_readv (False); both land
    every block byte-exact."""
    from tiersync.tiers.host import HostArena, HostArenaConfig

    rng = np.random.default_rng(5)
    arena = HostArena(HostArenaConfig(num_blocks=96, block_nbytes=64 << 10, shareable=True))
    keys = [i.to_bytes(16, "little") for i in range(96)]
    blocks = {k: arena.block(b) for k, b in zip(keys, arena.allocate(96))}
    for view in blocks.values():
        view[:] = rng.bytes(64 << 10)
    transport = TcpTransport(TcpConfig(route=Route.LOCAL, local_threads=2, local_maps=local_maps))
    server = transport.serve("127.0.0.1:0", MemoryBlockSource(blocks, shared=[arena.shared]))
    channel = transport.connect(server.address)
    try:
        lease = channel.request(so.ReadLease(channel.new_request_id(), tuple(keys), ttl_s=60)).lease_id
        dests = [memoryview(bytearray(64 << 10)) for _ in keys]
        channel.pull_many(lease, [(k, 0, d) for k, d in zip(keys, dests)])
        assert all(bytes(d) == bytes(blocks[k]) for k, d in zip(keys, dests))
        # the process's maps (its channels share them) hold this arena's, or hold none
        assert channel.mapped_sources >= 1 if local_maps else channel.mapped_sources == 0
    finally:
        channel.close()
        server.close()
        blocks.clear()
        arena.close()
    with pytest.raises(UsageError) as exc:
        MemoryBlockSource({}, shared=[(1, 2, 3)])
    assert exc.value.argument == "shared"


def test_a_map_of_a_memfd_its_living_process_closed_goes_when_it_maps_another():
    """A process that lives on (an in-process server, a producer that re-registered) closes a
    shareable memfd a reader mapped: the reader drops that map when it next maps one of the
    process's memfds, instead of keeping the closed file's memory allocated for good."""
    from tiersync.tiers.shareable import open_shareable

    maps = SharedMaps()
    fd, owner = open_shareable(1 << 20)
    assert maps.map(os.getpid(), (fd, 0, 1 << 20, 0)) is not None and maps.count(os.getpid()) == 1
    owner.close()
    os.close(fd)
    keep = os.open(os.devnull, os.O_RDONLY)  # takes the old number: the new memfd gets another
    fd2, owner2 = open_shareable(1 << 20)
    try:
        assert fd2 != fd and maps.map(os.getpid(), (fd2, 0, 1 << 20, 0)) is not None
        assert maps.count(os.getpid()) == 1
    finally:
        maps.close()
        owner2.close()
        os.close(fd2)
        os.close(keep)


def test_allow_readers_asks_the_kernel_once_per_process_and_again_in_a_forked_child(monkeypatch):
    """A server calls it at every same-host read: one prctl per process, not one per read."""
    calls: list[int] = []

    class Spy:
        def prctl(self, *args):
            calls.append(os.getpid())
            return 0

    monkeypatch.setattr(local, "_libc", Spy())
    monkeypatch.setattr(local, "_allowed_in", [0])
    for _ in range(3):
        local.allow_readers()
    assert calls == [os.getpid()]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its own process, so its own prctl
        local.allow_readers()
        os.write(w, str(len(calls)).encode())
        os._exit(0)
    os.close(w)
    got = os.read(r, 16)
    os.waitpid(pid, 0)
    os.close(r)
    assert got == b"2"
