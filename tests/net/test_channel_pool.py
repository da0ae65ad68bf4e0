"""tiersync.net.pool (the ChannelPool): the one client connection pool, with a cap on the channels open to a peer
(the samplers' streams), against a real block server process."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from _peer import TOKEN, block_server, blocked_reader
from tiersync.errors import ClosedError, RemoteError, UsageError
from tiersync.net import events as ev
from tiersync.net import store_ops as so
from tiersync.net.config import TcpConfig
from tiersync.net.errors import PeerClosedError, RequestError
from tiersync.net.pool import ChannelPool
from tiersync.net.tcp import TcpTransport


@pytest.fixture(scope="module")
def peer():
    with block_server(TcpConfig(token=TOKEN), {b"K" * 16: b"v" * 64}) as address:
        yield address


def _pool(cap: int | None = 2) -> ChannelPool:
    return ChannelPool(TcpTransport(TcpConfig(token=TOKEN)), max_idle_per_peer=4, max_open_per_peer=cap)


def _ping(channel, token: int = 1) -> int:
    return channel.request(ev.Ping(channel.new_request_id(), token)).token


def test_at_the_cap_an_acquire_waits_for_a_channel_to_come_back_and_gets_that_one(peer):
    pool = _pool(2)
    got: list[object] = []
    with pool.acquire(peer) as first, pool.acquire(peer) as second:
        with pytest.raises(RemoteError, match="no connection became free"), pool.acquire(peer, timeout=0.2):
            pass
        waiter = threading.Thread(target=lambda: got.append(_take_one(pool, peer)))
        waiter.start()
        assert _waiting(pool)
    waiter.join(10)
    assert got and got[0] in (first, second) and pool.idle_count(peer) == 2
    pool.close()


def _waiting(pool: ChannelPool, timeout: float = 10.0) -> bool:
    """Whether a caller came to wait on the pool's condition (a freed channel) within ``timeout``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with pool._lock:
            if pool._freed._waiters:  # type: ignore[attr-defined]
                return True
        time.sleep(0.01)
    return False


def _take_one(pool: ChannelPool, peer: str) -> object:
    with pool.acquire(peer, timeout=10) as channel:
        assert _ping(channel, 5) == 5
        return channel


def test_a_channel_that_broke_frees_its_place_under_the_cap(peer):
    pool = _pool(1)
    with pytest.raises(KeyError), pool.acquire(peer) as broken:
        raise KeyError("the caller failed between a request and its answer")
    assert broken.closed and pool.idle_count(peer) == 0
    with pool.acquire(peer, timeout=5) as channel:  # not waiting on the closed one
        assert channel is not broken and _ping(channel) == 1
    pool.close()


def test_a_refused_request_among_others_in_flight_closes_the_channel(peer):
    """A refusal may leave the answers of requests sent with it on the way (or already read):
    a channel handed out again would give its next user those answers."""
    pool = _pool(1)
    with pytest.raises(RequestError), pool.acquire(peer) as refused:
        refused.send_many([so.Pull(1, 999, b"K" * 16, 0, 4), ev.Ping(2, 7)])  # no such lease
        refused.next_answer(1, timeout=5)
    assert refused.closed
    with pool.acquire(peer, timeout=5) as again:
        assert again is not refused and _ping(again) == 1
    pool.close()


def test_a_pool_closed_while_a_channel_connected_closes_that_one_too(peer, monkeypatch):
    pool = _pool(2)
    real = pool._transport.connect
    opened: list[object] = []

    def connect_then_close(address, timeout=None):
        channel = real(address, timeout=timeout)
        opened.append(channel)
        pool.close(abort=True)  # it closes between the connect and the hand-out
        return channel

    monkeypatch.setattr(pool._transport, "connect", connect_then_close)
    with pytest.raises(ClosedError), pool.acquire(peer, timeout=5):
        pass
    assert opened and opened[0].closed


def test_a_connect_that_fails_frees_its_place():
    pool = ChannelPool(TcpTransport(TcpConfig(token=TOKEN, connect_timeout_s=1)), max_open_per_peer=1)
    with pytest.raises(RemoteError), pool.acquire("127.0.0.1:1", timeout=2):  # nothing listens on port 1
        pass
    with pytest.raises(RemoteError) as info, pool.acquire("127.0.0.1:1", timeout=2):
        pass
    assert "no connection became free" not in str(info.value)  # it tried to connect again
    pool.close()


def test_a_connect_is_bounded_by_its_own_timeout_inside_a_longer_wait():
    """A caller may wait its whole deadline for a channel under the cap, while a peer that
    accepts and never answers the handshake is given up after ``connect_timeout``."""
    mute = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel's backlog), never speaks
    address = f"127.0.0.1:{mute.getsockname()[1]}"
    pool = ChannelPool(TcpTransport(TcpConfig(token=TOKEN, connect_timeout_s=60)), max_open_per_peer=1)
    try:
        t0 = time.monotonic()
        with pytest.raises(RemoteError), pool.acquire(address, timeout=60, connect_timeout=0.5):
            pass
        assert time.monotonic() - t0 < 10  # the connect's bound, not the wait's 60 s
        assert pool._open.get(address) is None  # its place under the cap was given back
    finally:
        pool.close()
        mute.close()


def test_closing_with_abort_wakes_a_lent_channels_blocked_read_and_refuses_new_ones(peer):
    pool = _pool(2)
    with pool.acquire(peer) as lent:
        reader, outcome = blocked_reader(lent)
        started = time.monotonic()
        pool.close(abort=True)
        reader.join(10)
        assert not reader.is_alive() and time.monotonic() - started < 10
        assert len(outcome) == 1 and isinstance(outcome[0], PeerClosedError), repr(outcome)
        assert lent.closed
    with pytest.raises(ClosedError), pool.acquire(peer):
        pass


def test_without_abort_a_lent_channel_is_closed_when_it_comes_back(peer):
    pool = _pool(None)
    with pool.acquire(peer) as lent:
        pool.close()
        assert not lent.closed and _ping(lent) == 1
    assert lent.closed


def test_its_settings_are_checked_naming_them():
    transport = TcpTransport(TcpConfig(token=TOKEN))
    for kwargs, name in (
        ({"max_open_per_peer": 0}, "max_open_per_peer"),
        ({"max_idle_per_peer": True}, "max_idle_per_peer"),
        ({"max_idle_s": 0}, "max_idle_s"),
    ):
        with pytest.raises(UsageError, match=name):
            ChannelPool(transport, **kwargs)
