"""tiersync.net.parking: parked sessions alone, then requests parked on a real server with two workers."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from _wait import until
from tiersync.net import events as ev
from tiersync.net.config import TcpConfig
from tiersync.net.errors import RequestError
from tiersync.net.parking import ParkedSessions
from tiersync.net.service import Park, Service
from tiersync.net.tcp import TcpTransport
from tiersync.net.vocab import Vocabulary


class _Watch:
    """A watch that keeps its wakes until ``fire``."""

    def __init__(self) -> None:
        self.wakes: list = []

    def __call__(self, wake) -> None:
        self.wakes.append(wake)

    def fire(self) -> None:
        for wake in self.wakes:
            wake()


def test_a_parked_session_is_resumed_once_with_its_request_whoever_wakes_it():
    resumed: list = []
    parked = ParkedSessions(lambda s, request: resumed.append((s, request)))
    watch = _Watch()
    parked.park("s", "req", Park(watch, time.monotonic() + 60))
    assert len(parked) == 1 and not resumed
    watch.fire()
    watch.fire()
    parked.expire(time.monotonic() + 120)  # its deadline entry is stale now
    assert parked.resume("s") is False
    assert resumed == [("s", "req")] and len(parked) == 0


def test_a_wake_of_an_earlier_park_does_not_resume_the_sessions_next_park():
    resumed: list = []
    parked = ParkedSessions(lambda s, request: resumed.append(request))
    first, second = _Watch(), _Watch()
    parked.park("s", 1, Park(first, time.monotonic() + 60))
    first.fire()
    parked.park("s", 2, Park(second, time.monotonic() + 60))
    first.fire()  # late: the first park's token
    assert resumed == [1] and len(parked) == 1
    second.fire()
    assert resumed == [1, 2]


def test_expire_resumes_only_the_parks_whose_deadline_passed():
    resumed: list = []
    parked = ParkedSessions(lambda s, request: resumed.append(s))
    now = time.monotonic()
    for name, after in (("late", 50), ("soon", 5), ("sooner", 1)):
        parked.park(name, None, Park(_Watch(), now + after))
    parked.expire(now + 10)
    assert resumed == ["sooner", "soon"] and len(parked) == 1


def test_a_watch_that_raises_leaves_the_session_not_parked():
    parked = ParkedSessions(lambda s, request: None)

    def broken(wake) -> None:
        raise RuntimeError("a service bug")

    with pytest.raises(RuntimeError):
        parked.park("s", None, Park(broken, time.monotonic() + 60))
    assert len(parked) == 0 and parked.resume("s") is False


def test_a_watch_that_raises_after_it_woke_the_session_leaves_it_to_the_resumed_worker():
    resumed: list = []
    parked = ParkedSessions(lambda s, request: resumed.append(s))

    def wakes_then_fails(wake) -> None:
        wake()
        raise RuntimeError("a service bug after the wake")

    parked.park("s", None, Park(wakes_then_fails, time.monotonic() + 60))  # logged, not raised
    assert resumed == ["s"] and len(parked) == 0


class _Gated(Service):
    """PING token 0 parks until ``open_gate`` (or until ``park_s`` passed: then ERROR); any
    other PING is answered at once."""

    vocabulary = Vocabulary("gated", {}, include=(ev.CORE,))

    def __init__(self, park_s: float = 60.0) -> None:
        self.park_s, self.open = park_s, False
        self.lock, self.wakes, self.first = threading.Lock(), [], {}
        self.closed_sessions: list = []

    def handle(self, session, event):
        if isinstance(event, ev.Ping) and event.token == 7:  # ends its own session, then parks
            session.close()
            return Park(lambda wake: None, time.monotonic() + 600)
        if not (isinstance(event, ev.Ping) and event.token == 0):
            return [ev.Pong(event.request_id, event.token)]
        deadline = self.first.setdefault((session.session_id, event.request_id), time.monotonic() + self.park_s)
        with self.lock:
            if self.open:
                return [ev.Pong(event.request_id, 0)]
        if time.monotonic() >= deadline:
            return [ev.Error(event.request_id, ev.ErrorCode.LEASE_EXPIRED, "gate still shut")]
        return Park(self._watch, deadline)

    def _watch(self, wake) -> None:
        with self.lock:
            if not self.open:
                self.wakes.append(wake)
                return
        wake()

    def open_gate(self) -> None:
        with self.lock:
            self.open, wakes, self.wakes = True, self.wakes, []
        for wake in wakes:
            wake()

    def closed(self, session) -> None:
        self.closed_sessions.append(session.session_id)


@contextlib.contextmanager
def _served(park_s: float = 60.0) -> Iterator[tuple[_Gated, Any, Any]]:
    """A :class:`_Gated` service on a server with two workers, and one channel to it."""
    service = _Gated(park_s)
    server = TcpTransport(TcpConfig(workers=2), service.vocabulary).serve("127.0.0.1:0", service)
    ch = TcpTransport(TcpConfig(), service.vocabulary).connect(server.address)
    try:
        yield service, server, ch
    finally:
        ch.close()
        server.close()


def test_parked_requests_hold_no_worker_and_are_answered_in_order_once_woken():
    """Two workers, four sessions each with a PING parked and another pipelined behind it: a
    fifth session is answered at once (the workers are free); opening the gate answers each
    session's two PINGs in order. Blocking in the handler instead held both workers, and the
    fifth waited for the gate."""
    service = _Gated()
    server = TcpTransport(TcpConfig(workers=2), service.vocabulary).serve("127.0.0.1:0", service)
    transport = TcpTransport(TcpConfig(), service.vocabulary)
    channels = [transport.connect(server.address) for _ in range(4)]
    try:
        asked = []
        for ch in channels:
            pings = [ev.Ping(ch.new_request_id(), 0), ev.Ping(ch.new_request_id(), 1)]
            ch.send_many(pings)
            asked.append(pings)
        assert until(lambda: len(server._responder.parked) == 4)
        fifth = transport.connect(server.address)
        assert fifth.request(ev.Ping(fifth.new_request_id(), 5), timeout=5).token == 5
        fifth.close()
        service.open_gate()
        for ch, pings in zip(channels, asked):
            assert [ch.next_answer(p.request_id, timeout=10).token for p in pings] == [0, 1]
    finally:
        for ch in channels:
            ch.close()
        server.close()


def test_a_parked_request_is_asked_again_at_its_deadline():
    with _served(park_s=0.3) as (_service, _server, ch):
        t0 = time.monotonic()
        ping = ev.Ping(ch.new_request_id(), 0)
        ch.send(ping)
        with pytest.raises(RequestError) as info:
            ch.next_answer(ping.request_id, timeout=10)
        assert info.value.code is ev.ErrorCode.LEASE_EXPIRED
        assert time.monotonic() - t0 < 5  # the loop looks at deadlines at least once a second
        assert ch.request(ev.Ping(ch.new_request_id(), 3), timeout=5).token == 3  # the session goes on


def test_a_session_ended_while_parked_is_released_once():
    """The server closes with sessions parked: the service hears of each once, and their
    sockets close (each went back through a worker that found it ended)."""
    service = _Gated()
    server = TcpTransport(TcpConfig(workers=2), service.vocabulary).serve("127.0.0.1:0", service)
    channels = [TcpTransport(TcpConfig(), service.vocabulary).connect(server.address) for _ in range(3)]
    for ch in channels:
        ch.send(ev.Ping(ch.new_request_id(), 0))
    assert until(lambda: len(server._responder.parked) == 3)
    sessions = list(server._sessions)
    server.close()
    try:
        assert sorted(service.closed_sessions) == sorted(s.session_id for s in sessions)
        assert until(lambda: all(s.sock.fileno() == -1 for s in sessions))
        assert len(server._responder.parked) == 0
    finally:
        for ch in channels:
            ch.close()


def test_a_session_ended_before_its_request_parked_is_released():
    with _served() as (service, server, ch):
        ch.send(ev.Ping(ch.new_request_id(), 7))
        assert until(lambda: len(service.closed_sessions) == 1)
        assert until(lambda: server.connections == 0)  # else parked with a closed socket until its deadline
        assert len(server._responder.parked) == 0


def test_a_parked_session_no_worker_can_take_is_ended_and_released():
    """Woken when its pool can take no more work (here shut down; a thread that cannot start
    alike): the session ends and its socket is released, not left on no worker and in no selector."""
    with _served() as (service, server, ch):
        ch.send(ev.Ping(ch.new_request_id(), 0))
        assert until(lambda: len(server._responder.parked) == 1)
        server._workers.shutdown(wait=True)
        service.open_gate()
        assert until(lambda: server.connections == 0) and len(service.closed_sessions) == 1


def test_a_parked_session_whose_peer_hangs_up_ends_before_its_deadline():
    with _served(park_s=600) as (service, server, ch):
        ch.send(ev.Ping(ch.new_request_id(), 0))
        assert until(lambda: len(server._responder.parked) == 1)
        ch.close()
        assert until(lambda: len(service.closed_sessions) == 1 and server.connections == 0)
        assert len(server._responder.parked) == 0


def test_requests_sent_to_a_parked_session_wait_for_it_and_are_answered_in_order():
    with _served() as (service, server, ch):
        first = ev.Ping(ch.new_request_id(), 0)
        ch.send(first)
        assert until(lambda: len(server._responder.parked) == 1)
        later = [ev.Ping(ch.new_request_id(), token) for token in (1, 2)]
        ch.send_many(later)  # arrive while it is parked: they wait in its socket
        assert not until(lambda: len(server._responder.parked) == 0, timeout=0.5)
        service.open_gate()
        assert [ch.next_answer(p.request_id, timeout=10).token for p in (first, *later)] == [0, 1, 2]
        assert not service.closed_sessions


def test_a_parked_session_whose_peer_hangs_up_behind_requests_it_sent_later_ends_before_its_deadline():
    """A reader keeps a window of requests in flight: some arrive after its request parked,
    and it dies behind them. Its hang-up is seen under the unread bytes."""
    with _served(park_s=600) as (service, server, ch):
        ch.send(ev.Ping(ch.new_request_id(), 0))
        assert until(lambda: len(server._responder.parked) == 1)
        ch.send_many([ev.Ping(ch.new_request_id(), token) for token in (1, 2)])
        threading.Event().wait(0.3)  # they are in the server's socket, unread
        ch.close()
        assert until(lambda: len(service.closed_sessions) == 1 and server.connections == 0)
