"""tiersync.net.responder: a turn's deadlines, held answers and hand-backs over a real server."""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading

import pytest

from _wait import until
from tiersync.errors import TierSyncError
from tiersync.net import events as ev
from tiersync.net.config import TcpConfig
from tiersync.net.server_session import ServerSession
from tiersync.net.vocab import Vocabulary


@pytest.mark.parametrize("streamed", [False, True])
def test_each_pipelined_request_gets_op_timeout_s_of_its_own(streamed):
    """A handler may wait before answering (a trainer's GET waits for its tensor to be written):
    four pipelined requests that each wait 0.4 s with op_timeout_s 1 s are all answered. One
    deadline for the whole turn ran out at the third, and the session was closed."""
    from tiersync.net.service import Service
    from tiersync.net.tcp import TcpTransport

    never = threading.Event()

    class Waits(Service):
        vocabulary = Vocabulary("waits", {}, include=(ev.CORE,))

        def handle(self, session, event):
            if streamed:
                return self._yields(event)
            never.wait(0.4)
            return [ev.Pong(event.request_id, event.token)]

        def _yields(self, event):
            never.wait(0.4)
            yield ev.Pong(event.request_id, event.token)

    transport = TcpTransport(TcpConfig(op_timeout_s=1.0), Waits.vocabulary)
    server = transport.serve("127.0.0.1:0", Waits())
    try:
        ch = TcpTransport(TcpConfig(op_timeout_s=30.0), Waits.vocabulary).connect(server.address)
        pings = [ev.Ping(ch.new_request_id(), token) for token in range(4)]
        ch.send_many(pings)
        assert [ch.next_answer(p.request_id, timeout=30).token for p in pings] == [0, 1, 2, 3]
        ch.close()
    finally:
        server.close()


def test_a_session_ended_by_another_thread_keeps_its_socket_until_the_worker_hands_it_back():
    """Another thread ends a session (a failed Session.send, a service's close) while a worker
    still answers on it: the server closes the socket only once the worker handed the session
    back. Closed at once, its number could go to the next accepted connection while the worker
    still reads or writes by it (another peer's bytes read, or this session's answers written
    to a stranger)."""
    from tiersync.net.service import Service
    from tiersync.net.tcp import TcpTransport

    inside, leave = threading.Event(), threading.Event()
    held: list[ServerSession] = []

    class Blocks(Service):
        vocabulary = Vocabulary("blocks", {}, include=(ev.CORE,))

        def handle(self, session, event):
            held.append(session)
            inside.set()
            leave.wait(30)
            return [ev.Pong(event.request_id, event.token)]

    server = TcpTransport(TcpConfig(), Blocks.vocabulary).serve("127.0.0.1:0", Blocks())
    try:
        ch = TcpTransport(TcpConfig(), Blocks.vocabulary).connect(server.address)
        ch.send(ev.Ping(ch.new_request_id(), 1))
        assert inside.wait(30)
        session = held[0]
        session.close()  # another thread ends it while the worker is inside the handler
        for _ in range(3):  # give the loop turns to (wrongly) close the socket
            TcpTransport(TcpConfig(), Blocks.vocabulary).connect(server.address).close()
        assert session.closed and session.sock.fileno() != -1  # still the worker's
        leave.set()
        assert until(lambda: session.sock.fileno() == -1)  # handed back: closed
        ch.close()
    finally:
        leave.set()
        server.close()


def test_peers_that_keep_sending_do_not_keep_the_workers_from_another_session():
    """Two workers, two peers pipelining PINGs as fast as they can (reading their answers off
    the socket): a worker reads on for a session only so many turns, then hands it back to the
    loop, so a third session's PING is answered while they go on (it waited for them to stop)."""
    from tiersync.net.server import TcpServer
    from tiersync.net.source import MemoryBlockSource
    from tiersync.net.tcp import TcpTransport

    cfg = TcpConfig(token=b"responder-test-token-0123", workers=2)
    server, stop, threads = TcpServer("127.0.0.1:0", MemoryBlockSource({}), cfg), threading.Event(), []
    flooding = threading.Barrier(3)

    def flood() -> None:
        channel = TcpTransport(cfg).connect(server.address, timeout=5)
        drain = threading.Thread(target=_drain, args=(channel._framed.sock, stop))  # answers read raw, fast
        drain.start()
        threads.append(drain)
        with contextlib.suppress(TierSyncError, OSError):
            for n in itertools.count():
                if stop.is_set():
                    break
                channel.send_many([ev.Ping(channel.new_request_id(), 1) for _ in range(2000)], timeout=10)
                if n == 4:  # well under way
                    flooding.wait(10)
        channel.close()

    try:
        threads += [threading.Thread(target=flood) for _ in range(2)]
        for t in threads[:2]:
            t.start()
        victim = TcpTransport(cfg).connect(server.address, timeout=5)
        flooding.wait(10)
        assert victim.request(ev.Ping(victim.new_request_id(), 9), timeout=5).token == 9
        victim.close()
    finally:
        stop.set()
        server.close()
        for t in list(threads):
            t.join(10)


def _drain(sock: socket.socket, stop: threading.Event) -> None:
    with contextlib.suppress(OSError):
        while not stop.is_set() and sock.recv(1 << 20):
            pass


BIG = 48 << 20  # more than the server's send buffer and a small receive buffer hold


@pytest.fixture(scope="module")
def tls_pair(tmp_path_factory):
    """(server TlsConfig, client TlsConfig) of a throwaway CA."""
    pytest.importorskip("cryptography")
    from _certs import make_ca, make_leaf
    from tiersync.net.tls import TlsConfig

    d = tmp_path_factory.mktemp("pki")
    ca = make_ca(d)
    return TlsConfig(ca[2], *make_leaf(d, ca, "server")), TlsConfig(ca[2])


def _hostile(address: str, key: bytes, token: bytes, tls: object = None) -> tuple[object, int]:
    """A client that asks for ``key`` (BIG bytes) and a PING behind it, and reads nothing yet."""
    from tiersync.net import store_ops as so
    from tiersync.net.tcp import TcpTransport

    ch = TcpTransport(TcpConfig(token=token, rcvbuf=64 << 10, tls=tls)).connect(address)
    lease = ch.request(so.ReadLease(ch.new_request_id(), (key,), 600))
    pull, ping = ch.new_request_id(), ch.new_request_id()
    ch.send_many([so.Pull(pull, lease.lease_id, key, 0, BIG), ev.Ping(ping, 7)])
    return ch, pull


@pytest.mark.parametrize("secure", [False, True], ids=["tcp", "tls"])
def test_peers_that_do_not_read_their_answers_hold_no_worker_and_a_late_reader_gets_every_byte(secure, request):
    """Two server workers, three peers that asked for 48 MiB and read nothing: each worker waits
    at most a second for its peer to take the answer, then the rest waits for room without it,
    so another client is answered at once (the peers held both workers for op_timeout_s
    before; over TLS until this change). A peer that reads late gets the whole answer
    byte-exact, then the PING it sent behind it; a peer that hangs up ends its session, and so
    does one that reads nothing by op_timeout_s (8 s here)."""
    import os

    from tiersync.net.source import MemoryBlockSource
    from tiersync.net.tcp import TcpTransport

    served, tls = request.getfixturevalue("tls_pair") if secure else (None, None)
    token, key, data = b"h" * 32, b"B" * 16, os.urandom(BIG)
    server = TcpTransport(TcpConfig(token=token, workers=2, op_timeout_s=8.0, tls=served)).serve(
        "127.0.0.1:0", MemoryBlockSource({key: data, b"s" * 16: b"small"})
    )
    peers = [_hostile(server.address, key, token, tls) for _ in range(3)]
    try:
        honest = TcpTransport(TcpConfig(token=token, tls=tls)).connect(server.address)
        assert honest.request(ev.Ping(honest.new_request_id(), 1), timeout=5.0).token == 1
        late, pull = peers[0]
        answer = late.next_answer(pull, timeout=30.0)  # reads now: what was held goes out
        parts = answer.payload if isinstance(answer.payload, list) else [answer.payload]
        assert b"".join(map(bytes, parts)) == data
        assert late.next_answer(pull + 1, timeout=10.0).token == 7  # the request behind it was answered
        peers[1][0].close()  # hangs up; peers[2] reads nothing, for good
        assert until(lambda: server.connections == 2, 15.0)  # the late reader and the honest client
        honest.close()
        late.close()
    finally:
        for ch, _ in peers:
            ch.close()
        server.close()


def test_an_idle_session_whose_peer_resets_is_ended_and_its_service_told():
    """An authenticated peer, idle between requests, resets its connection (an RST: killed, or
    closed with unread bytes). The server ends the session and the service's ``closed`` runs
    (a reset is an error event on the socket: it must go to the reader of a session registered
    for reading, not to the writer of held answers)."""
    import struct

    from tiersync.net.source import MemoryBlockSource
    from tiersync.net.tcp import TcpTransport

    closed = threading.Event()

    class Source(MemoryBlockSource):
        def closed(self, session) -> None:
            super().closed(session)
            closed.set()

    token = b"r" * 32
    server = TcpTransport(TcpConfig(token=token)).serve("127.0.0.1:0", Source({}))
    try:
        ch = TcpTransport(TcpConfig(token=token)).connect(server.address)
        assert ch.request(ev.Ping(ch.new_request_id(), 1), timeout=5.0).token == 1
        sock: socket.socket = ch._framed.sock
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        ch.close()  # linger 0: the close sends an RST
        assert closed.wait(10) and until(lambda: server.connections == 0, 10.0)
    finally:
        server.close()


def test_answers_written_before_a_park_are_held_too_and_the_parked_request_is_asked_again_after():
    """Two peers, as many as workers, pipeline a PULL of 48 MiB and a PING the service parks,
    and read nothing. The PULL's answer, written before the park, is held like any other (it
    was written on the worker until op_timeout_s, and another client timed out), and the PING
    is asked again once it went out: the late reader gets every byte, then its PONG."""
    import os
    import time

    from tiersync.net.service import Park
    from tiersync.net.source import MemoryBlockSource
    from tiersync.net.tcp import TcpTransport

    released, wakes = threading.Event(), []

    class ParksPings(MemoryBlockSource):
        def handle(self, session, event):
            if isinstance(event, ev.Ping) and not released.is_set():
                return Park(wakes.append, time.monotonic() + 60)
            return super().handle(session, event)

    token, key, data = b"p" * 32, b"B" * 16, os.urandom(BIG)
    server = TcpTransport(TcpConfig(token=token, workers=2, op_timeout_s=30.0)).serve(
        "127.0.0.1:0", ParksPings({key: data, b"s" * 16: b"small"})
    )
    peers = [_hostile(server.address, key, token) for _ in range(2)]  # as many as workers
    try:
        from tiersync.net import store_ops as so

        honest = TcpTransport(TcpConfig(token=token)).connect(server.address)
        lease = honest.request(so.ReadLease(honest.new_request_id(), (b"s" * 16,), 60), timeout=5.0)
        got = bytearray(5)
        honest.request(so.Pull(honest.new_request_id(), lease.lease_id, b"s" * 16, 0, 5), timeout=5.0, into=got)
        assert got == b"small"
        peers.append(_hostile(server.address, key, token))  # a third: it too gets a worker at once
        released.set()
        late, pull = peers[0]
        answer = late.next_answer(pull, timeout=30.0)
        parts = answer.payload if isinstance(answer.payload, list) else [answer.payload]
        assert b"".join(map(bytes, parts)) == data
        assert late.next_answer(pull + 1, timeout=10.0).token == 7  # asked again once the PULL went out
        honest.close()
    finally:
        for ch, _ in peers:
            ch.close()
        server.close()


def test_a_request_woken_again_and_again_is_answered_late_at_its_first_parks_deadline():
    """A service parks each PING with late answers and a watch that wakes it 50 ms later, the
    answer still not there (a tensor's part written, not the one this GET waits for): the
    server keeps the first park's 1 s deadline across the re-parks and answers ``late`` then;
    the next PING gets a deadline of its own. The handler keeps no state for it."""
    import time

    from tiersync.net.service import Park, Service
    from tiersync.net.tcp import TcpTransport

    asked: list[int] = []

    class NeverReady(Service):
        vocabulary = Vocabulary("late", {}, include=(ev.CORE,))

        def handle(self, session, event):
            asked.append(event.request_id)
            late = (ev.Pong(event.request_id, 99),)
            return Park(lambda wake: threading.Timer(0.05, wake).start(), time.monotonic() + 1.0, late)

    server = TcpTransport(TcpConfig(), NeverReady.vocabulary).serve("127.0.0.1:0", NeverReady())
    try:
        ch = TcpTransport(TcpConfig(), NeverReady.vocabulary).connect(server.address)
        for _ in range(2):
            rid = ch.new_request_id()
            began = time.monotonic()
            assert ch.request(ev.Ping(rid, 1), timeout=10.0).token == 99
            assert time.monotonic() - began >= 0.9 and asked.count(rid) >= 5  # woken, re-parked, then late
        ch.close()
    finally:
        server.close()


def test_a_pinned_data_in_a_handlers_list_is_held_like_a_streams_and_holds_no_worker():
    """A service answers PULLs with a plain list whose DATA is pinned (its bytes stay until
    read). Two peers, as many as workers, pull 48 MiB and read nothing: the list is answered
    like a stream, its DATA held once the peer does not take it, so another client is answered
    at once (the pinned DATA was written on the worker until op_timeout_s, and the other client
    timed out). The late reader gets every byte, then the PONG it asked for behind it."""
    import dataclasses
    import os

    from tiersync.net import store_ops as so
    from tiersync.net.source import MemoryBlockSource
    from tiersync.net.tcp import TcpTransport

    class PinsPulls(MemoryBlockSource):
        def handle(self, session, event):
            answers = super().handle(session, event)
            if not isinstance(event, so.Pull):
                return answers
            return [dataclasses.replace(a, pinned=True) if isinstance(a, ev.Data) else a for a in answers]

    token, key, data = b"q" * 32, b"B" * 16, os.urandom(BIG)
    server = TcpTransport(TcpConfig(token=token, workers=2, op_timeout_s=30.0)).serve(
        "127.0.0.1:0", PinsPulls({key: data})
    )
    peers = [_hostile(server.address, key, token) for _ in range(2)]  # as many as workers
    try:
        honest = TcpTransport(TcpConfig(token=token)).connect(server.address)
        assert honest.request(ev.Ping(honest.new_request_id(), 1), timeout=5.0).token == 1
        late, pull = peers[0]
        answer = late.next_answer(pull, timeout=30.0)
        parts = answer.payload if isinstance(answer.payload, list) else [answer.payload]
        assert b"".join(map(bytes, parts)) == data
        assert late.next_answer(pull + 1, timeout=10.0).token == 7
        honest.close()
    finally:
        for ch, _ in peers:
            ch.close()
        server.close()


def test_a_handlers_list_of_one_park_behind_held_answers_is_asked_again_once_they_are_written():
    """A PING answered ``[Park]`` (a list, not a bare Park) behind a PULL whose 48 MiB the peer
    does not read yet: once the PULL went out the PING is asked again, like a bare Park's, and
    answered with what is there by then (the list's Park, made before the hold, was kept and
    its deadline had passed: the PING got its late answer without being asked)."""
    import os
    import time

    from tiersync.net.service import Park
    from tiersync.net.source import MemoryBlockSource
    from tiersync.net.tcp import TcpTransport

    asked: list[float] = []

    class ParksPingsOnce(MemoryBlockSource):
        def handle(self, session, event):
            if not isinstance(event, ev.Ping):
                return super().handle(session, event)
            asked.append(time.monotonic())
            if len(asked) > 1:
                return [ev.Pong(event.request_id, event.token)]
            return [Park(lambda wake: None, time.monotonic() + 0.5, (ev.Pong(event.request_id, 99),))]

    token, key, data = b"o" * 32, b"B" * 16, os.urandom(BIG)
    server = TcpTransport(TcpConfig(token=token, workers=2, op_timeout_s=30.0)).serve(
        "127.0.0.1:0", ParksPingsOnce({key: data})
    )
    late, pull = _hostile(server.address, key, token)
    try:
        assert until(lambda: asked and time.monotonic() > asked[0] + 1.0, 10.0)  # its park's deadline passed
        answer = late.next_answer(pull, timeout=30.0)
        parts = answer.payload if isinstance(answer.payload, list) else [answer.payload]
        assert b"".join(map(bytes, parts)) == data
        assert late.next_answer(pull + 1, timeout=10.0).token == 7 and len(asked) == 2
    finally:
        late.close()
        server.close()
