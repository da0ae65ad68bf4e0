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

from tiersync.errors import UsageError
from tiersync.net import events as ev
from tiersync.net import local
from tiersync.net import store_ops as so
from tiersync.net.errors import ProtocolError, ProtocolFault
from tiersync.net.frames import PayloadChecksum, payload_checksum
from tiersync.net.samehost import local_copy, local_copy_at
from tiersync.net.source import MemoryBlockSource
from tiersync.net.tcp import Route, TcpConfig, TcpTransport
from tiersync.transfer.kernel import TSUM64, tsum64

pytestmark = pytest.mark.skipif(
    TSUM64 is None or not local.can_read(os.getpid()), reason="needs the native checksum and process_vm_readv"
)

NBYTES = 24 << 20
SIZES = [0, 1, 63, 64, 65, 4095, (256 << 10) - 1, 256 << 10, (256 << 10) + 1, 3 << 20, (5 << 20) + 17]
_CHILD = """
import sys, numpy as np
buf = np.random.default_rng(7).integers(0, 256, int(sys.argv[1]), dtype=np.uint8)
print(buf.ctypes.data, flush=True)
sys.stdin.read()
"""


def _expected() -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, NBYTES, dtype=np.uint8)


@pytest.fixture(scope="module")
def source():
    """(pid, address) of a buffer of NBYTES seeded bytes in another process."""
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(NBYTES)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        yield child.pid, int(child.stdout.readline())
    finally:
        child.stdin.close()
        child.wait(30)


def _ranges(address: int) -> list[tuple[int, int]]:
    out, off = [], 0
    for n in SIZES:
        out.append((address + off, n))
        off += n + 7  # ranges that do not start on a stripe boundary of the source
    return out


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
    blocks = {i.to_bytes(16, "little"): rng.bytes(64 << 10) for i in range(700)}  # 44 MiB: two PULL_LOCAL groups
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
