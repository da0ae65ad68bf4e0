"""PartialSums: a DATA of many whole blocks summed from the blocks' own checksums.

Mirrors the module doc: the composed checksum is tsum64 of the concatenation; None where it
cannot be composed (unknown or foreign checksums, a ragged block before the last, one block);
a block's state computed once and kept by (key, checksum), never more than ``limit`` kept;
bytes that changed since their checksum was taken raise ChangedBlock, before and after the
state was kept. Over TCP: a PULL_MANY of whole blocks arrives byte-exact with the composed
checksum, and a block changed in the server's memory is refused, never delivered.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from tiersync.errors import UsageError
from tiersync.net.frames import PayloadChecksum
from tiersync.net.partials import ChangedBlock, PartialSums
from tiersync.transfer import kernel

pytestmark = pytest.mark.skipif(kernel.TSUM64 is None, reason="native extension not built")
T = PayloadChecksum.TSUM64


def _blocks(sizes: list[int], seed: int = 0) -> list[tuple[bytes, memoryview, tuple[PayloadChecksum, int]]]:
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(sizes):
        data = memoryview(bytearray(rng.bytes(n)))
        out.append((bytes([i]) * 16, data, (T, kernel.tsum64(data))))
    return out


@pytest.mark.parametrize("sizes", [[64, 64], [4096] * 9, [65536, 128, 7], [0, 64, 100], [192, 1]])
def test_composed_is_the_checksum_of_the_concatenation(sizes):
    blocks = _blocks(sizes)
    want = kernel.tsum64(b"".join(bytes(v) for _, v, _ in blocks))
    assert PartialSums().composed(blocks) == (T, want)


def test_not_composed_where_it_cannot_be():
    sums = PartialSums()
    two = _blocks([64, 64])
    assert sums.composed(two[:1]) is None  # one block: its own checksum is already known
    assert sums.composed([two[0], (two[1][0], two[1][1], None)]) is None
    assert sums.composed([two[0], (two[1][0], two[1][1], (PayloadChecksum.XXH3_64, 5))]) is None
    assert sums.composed(_blocks([65, 64])) is None  # a block before the last ends mid-stripe
    assert len(sums) == 0  # nothing computed for any of them


def test_a_state_is_computed_once_per_key_and_checksum_and_bounded(monkeypatch):
    calls = []
    real = kernel.tsum64_partial
    monkeypatch.setattr(kernel, "tsum64_partial", lambda v: calls.append(len(v)) or real(v))
    sums = PartialSums(limit=3)
    blocks = _blocks([128, 128])
    for _ in range(3):
        sums.composed(blocks)
    assert calls == [128, 128] and len(sums) == 2
    sums.composed(_blocks([64, 64], seed=1)[:1] + blocks[:1])  # same key as block 0, other bytes: new state
    assert len(calls) == 3 and len(sums) == 3
    newer = _blocks([64, 64], seed=2)  # over the limit: the oldest states go first
    sums.composed(newer)
    assert len(sums) == 3 and len(calls) == 5
    sums.composed(newer)
    assert len(calls) == 5  # the newest are kept
    sums.composed(blocks)
    assert len(calls) == 7  # the oldest were dropped: computed again
    with pytest.raises(UsageError) as info:
        PartialSums(limit=0)
    assert info.value.argument == "limit"


def test_remembered_blocks_compose_without_reading_them_again(monkeypatch):
    """remember() returns a stored block's checksum and keeps its state from the same pass."""
    sums, blocks = PartialSums(), _blocks([4096, 4096, 100])
    assert [sums.remember(k, v) for k, v, _ in blocks] == [c for _, _, (_, c) in blocks]
    calls = []
    real = kernel.tsum64_partial
    monkeypatch.setattr(kernel, "tsum64_partial", lambda v: calls.append(len(v)) or real(v))
    want = kernel.tsum64(b"".join(bytes(v) for _, v, _ in blocks))
    assert sums.composed(blocks) == (T, want) and calls == []


def test_a_store_node_keeps_each_stored_block_s_state(monkeypatch):
    """A PULL_MANY of blocks a store node stored composes their checksum from what it kept when
    they landed: no pass over them at read time (1 MiB blocks are grouped since 4 MiB groups)."""
    from tiersync.net import events as ev
    from tiersync.net import store_ops as so
    from tiersync.net.store_node import StoreNode, StoreNodeClient, StoreNodeServer
    from tiersync.net.tcp import TcpConfig

    token, size = b"partials-token-0123456789", 64 << 10
    node = StoreNode(8 * size, size, config=TcpConfig(token=token))
    server = StoreNodeServer("127.0.0.1:0", node)
    try:
        keys, data = [bytes([9, i]) * 8 for i in range(4)], [os.urandom(size) for _ in range(4)]
        client = StoreNodeClient(server.address, token=token, timeout=10)
        assert client.offer_and_push(keys, data).commit is ev.CommitStatus.COMMITTED
        calls = []
        real = kernel.tsum64_partial
        monkeypatch.setattr(kernel, "tsum64_partial", lambda v: calls.append(len(v)) or real(v))
        lease = node.lease(so.ReadLease(1, tuple(keys)))
        found = node.views(lease.lease_id, [(k, 0, size) for k in keys])
        composed = node._partials.composed([(k, *v) for k, v in zip(keys, found)])
        assert composed == (T, kernel.tsum64(b"".join(data))) and calls == []
        into = [bytearray(size) for _ in keys]
        client.read(keys, into)
        assert [bytes(b) for b in into] == data and calls == []
    finally:
        server.close()
        node.close()


def test_bytes_changed_since_their_checksum_raise_before_and_after_the_state_was_kept():
    sums = PartialSums()
    blocks = _blocks([256, 256, 256])
    blocks[1][1][10] ^= 0xFF  # changed before any read: its state would not match its checksum
    with pytest.raises(ChangedBlock) as info:
        sums.composed(blocks)
    assert info.value.key == blocks[1][0] and blocks[1][0].hex() in str(info.value)
    blocks[1][1][10] ^= 0xFF
    composed = sums.composed(blocks)
    blocks[2][1][0] ^= 0x01  # changed after its state was kept: the composed value no longer fits
    assert sums.composed(blocks) == composed != (T, kernel.tsum64(b"".join(bytes(v) for _, v, _ in blocks)))


def test_pull_many_of_whole_blocks_is_byte_exact_and_a_changed_block_is_never_delivered():
    from tiersync.net import store_ops as so
    from tiersync.net.config import Route, TcpConfig
    from tiersync.net.errors import ProtocolError, ProtocolFault, RequestError
    from tiersync.net.source import MemoryBlockSource
    from tiersync.net.tcp import TcpTransport

    data = {bytes([i]) * 16: bytearray(os.urandom(4096)) for i in range(8)}
    keys, source = list(data), MemoryBlockSource(data)
    transport = TcpTransport(TcpConfig(route=Route.TCP))
    server = transport.serve("127.0.0.1:0", source)

    def pull_all() -> list[bytes]:
        ch = transport.connect(server.address)
        lease = ch.request(so.ReadLease(ch.new_request_id(), tuple(keys), ttl_s=60)).lease_id
        dests = [memoryview(bytearray(4096)) for _ in keys]
        ch.pull_many(lease, list(zip(keys, [0] * 8, dests)), window=2)  # one PULL_MANY of all 8
        ch.close()
        return [bytes(d) for d in dests]

    try:
        ch = transport.connect(server.address)
        lease = ch.request(so.ReadLease(ch.new_request_id(), tuple(keys), ttl_s=60)).lease_id
        ch.request(so.Pull(ch.new_request_id(), lease, keys[5], 0, 4096), into=bytearray(4096))  # its sum taken
        ch.close()
        data[keys[5]][100] ^= 0xFF  # then the server's copy changes
        with pytest.raises(RequestError, match="changed since its checksum"):  # the server refuses
            pull_all()
        data[keys[5]][100] ^= 0xFF
        assert pull_all() == [bytes(v) for v in data.values()]
        assert len(source._partials) == 8  # that DATA's checksum was composed from the blocks' own
        data[keys[2]][7] ^= 0x01  # changed after its state was kept: the reader refuses
        with pytest.raises(ProtocolError) as err:
            pull_all()
        assert err.value.fault is ProtocolFault.BAD_CHECKSUM
    finally:
        server.close()
