"""What every block server (tiersync.net.source.BlockService) bounds per connection, against a
real server process."""

from __future__ import annotations

import multiprocessing

import pytest

from _peer import TOKEN, run_block_server
from tiersync.net import events as ev
from tiersync.net import store_ops as so
from tiersync.net.errors import RequestError
from tiersync.net.source import MAX_SESSION_LEASES
from tiersync.net.tcp import TcpConfig, TcpTransport

KEY = b"L" * 16


@pytest.fixture(scope="module")
def served():
    ctx = multiprocessing.get_context("spawn")
    address_q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=run_block_server, args=(TcpConfig(token=TOKEN), {KEY: b"x" * 4096}, address_q, stop))
    proc.start()
    try:
        yield address_q.get(timeout=30)
    finally:
        stop.set()
        proc.join(10)


def test_one_connection_holds_a_bounded_number_of_leases(served):
    """Each lease pins its blocks until released: one connection gets MAX_SESSION_LEASES, the
    next is refused CAPACITY on a session that goes on, and a release makes room again."""
    ch = TcpTransport(TcpConfig(token=TOKEN)).connect(served)
    try:
        asks = [(so.ReadLease(ch.new_request_id(), (KEY,), 600), None) for _ in range(MAX_SESSION_LEASES)]
        granted: list[int] = []
        ch.pipeline(asks, window=64, landed=lambda _, reply: granted.append(reply.lease_id))
        assert len(set(granted)) == MAX_SESSION_LEASES
        with pytest.raises(RequestError) as info:
            ch.request(so.ReadLease(ch.new_request_id(), (KEY,), 600))
        assert info.value.code is ev.ErrorCode.CAPACITY and not ch.closed
        assert ch.request(so.Release(ch.new_request_id(), granted[0])).status is ev.CommitStatus.COMMITTED
        assert ch.request(so.ReadLease(ch.new_request_id(), (KEY,), 600)).status is so.LeaseStatus.GRANTED
    finally:
        ch.close()
