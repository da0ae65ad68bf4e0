"""tiersync.net.server_session: one session's writers over a real socket pair: deadlines,
answers held for a peer that does not read, and the writes queued behind them."""

from __future__ import annotations

import contextlib
import socket
import threading

import pytest

from _wait import until
from tiersync.errors import TierSyncError
from tiersync.net import events as ev
from tiersync.net.config import TcpConfig
from tiersync.net.errors import NetTimeoutError
from tiersync.net.server_session import ServerSession
from tiersync.net.socket_io import Deadline
from tiersync.net.vocab import Vocabulary


def test_a_writer_behind_one_stuck_on_a_peer_that_does_not_read_gives_up_at_its_own_deadline():
    """One writer blocks on a peer that reads nothing (until its 60 s deadline); another with a
    0.3 s deadline raises NetTimeoutError then, instead of queueing behind it for a minute, and
    the session ends (it could not be written to anyway)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        peer = socket.create_connection(listener.getsockname())
        ours, _ = listener.accept()
    ours.setblocking(False)
    ended: list[ServerSession] = []
    session = ServerSession(ended.append, TcpConfig(), Vocabulary("t", {}, include=(ev.CORE,)), ours, "peer", 1)
    stuck = threading.Thread(
        target=_quiet, args=(session.write, [bytes(64 << 20)], Deadline(60.0, "peer")), daemon=True
    )
    stuck.start()
    assert until(session.wlock.locked)
    outcome: list[BaseException] = []

    def second() -> None:
        try:
            session.write([b"x" * 64], Deadline(0.3, "peer"))
        except BaseException as exc:  # noqa: BLE001 - recorded and asserted below
            outcome.append(exc)

    waiter = threading.Thread(target=second, daemon=True)
    waiter.start()
    waiter.join(10)  # 60 s before: it waited for the stuck writer's deadline
    try:
        assert not waiter.is_alive() and isinstance(outcome[0], NetTimeoutError)
        assert ended == [session]
    finally:
        peer.close()
        ours.close()


def _pair() -> tuple[socket.socket, socket.socket]:
    """(ours, non-blocking; the peer's, with a small receive buffer) over loopback."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        peer = socket.create_connection(listener.getsockname())
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        ours, _ = listener.accept()
    ours.setblocking(False)
    return ours, peer


def test_writes_queue_behind_held_answers_up_to_a_cap_then_wait_for_them_or_end_the_session():
    """A peer that reads nothing has 64 MiB of answers held. Other writes (a publisher's
    ANNOUNCE) queue behind them up to 1 MiB and return; the next one waits for room. Once the
    peer reads and what is held is written, it goes out after them, every byte in order. A
    write past the cap on a peer that never reads raises NetTimeoutError at its deadline and
    ends the session (the queue grew without bound before)."""
    vocab = Vocabulary("t", {}, include=(ev.CORE,))
    ours, peer = _pair()
    ended: list[ServerSession] = []
    session = ServerSession(ended.append, TcpConfig(), vocab, ours, "peer", 1)
    big, small = bytes(range(256)) * (1 << 18), [bytes([i]) * (64 << 10) for i in range(16)]
    try:
        assert not session.write_or_hold([big], Deadline(60.0, "peer"))  # the peer reads nothing: held
        for chunk in small:  # 1 MiB queued: each returns at once
            session.write([chunk], Deadline(5.0, "peer"))
        waiter = threading.Thread(target=session.write, args=([b"last"], Deadline(30.0, "peer")))
        waiter.start()
        waiter.join(1.0)
        assert waiter.is_alive() and not ended  # past the cap: it waits
        got = bytearray()
        reader = threading.Thread(target=_collect, args=(peer, got, len(big) + (1 << 20) + 4))
        reader.start()
        assert until(lambda: session.write_or_hold([], Deadline(60.0, "peer")), 30.0)  # as the server does
        waiter.join(10)
        reader.join(30)
        assert got == big + b"".join(small) + b"last" and not ended
    finally:
        peer.close()
        ours.close()
    ours, peer = _pair()
    session = ServerSession(ended.append, TcpConfig(), vocab, ours, "peer", 2)
    try:
        assert not session.write_or_hold([big], Deadline(60.0, "peer"))
        session.write([bytes(1 << 20)], Deadline(5.0, "peer"))
        with pytest.raises(NetTimeoutError):
            session.write([b"x"], Deadline(0.5, "peer"))
        assert ended == [session]
    finally:
        peer.close()
        ours.close()


def _collect(sock: socket.socket, got: bytearray, nbytes: int) -> None:
    while len(got) < nbytes:
        chunk = sock.recv(1 << 20)
        if not chunk:
            return
        got += chunk


def _quiet(fn, *args) -> None:
    with contextlib.suppress(TierSyncError, OSError):
        fn(*args)


@pytest.mark.parametrize(
    ("mode", "ip", "expected"),
    [
        ("AUTO", "127.0.0.1", False),  # this kernel's loopback: copied (the reader's copy costs the host more)
        ("AUTO", "::1", False),
        ("AUTO", "192.0.2.7", True),  # TEST-NET-1: another host's address, by reference
        ("ALWAYS", "127.0.0.1", True),
        ("NEVER", "192.0.2.7", False),
    ],
)
def test_pinned_data_goes_by_reference_only_to_peers_off_this_hosts_loopback_unless_forced(mode, ip, expected):
    from tiersync.net.config import ByReference
    from tiersync.net.server_session import by_reference

    assert by_reference(ByReference[mode], ip) is expected


def test_the_by_reference_setting_is_validated_naming_it():
    with pytest.raises(TierSyncError) as info:
        TcpConfig(by_reference="always")
    assert "by_reference" in str(info.value)


def test_a_streams_rest_kept_for_held_answers_is_closed_when_the_session_ends_or_already_had():
    """What waits for held answers may be a stream's handler suspended after an answer (a
    weights GET that lent its buffer): ending the session closes it, so its cleanup runs at
    once; one kept after the session ended (a worker racing the server's shutdown) is closed
    right away instead of staying referenced from the session."""
    from tiersync.net.server_session import Rest

    cleaned: list[int] = []

    def stream(n: int):
        try:
            yield n
        finally:
            cleaned.append(n)

    ours, peer = _pair()
    try:
        session = ServerSession(lambda s: None, TcpConfig(), Vocabulary("t", {}, include=(ev.CORE,)), ours, "p", 1)
        first = stream(1)
        next(first)
        session.keep_then(Rest("req", first))
        assert cleaned == [] and session.then is not None
        session.drop_then()
        assert cleaned == [1] and session.then is None
        assert session.mark_closed()
        late = stream(2)
        next(late)
        session.keep_then(Rest("req", late))
        assert cleaned == [1, 2] and session.then is None
    finally:
        peer.close()
        ours.close()


def test_a_request_parked_again_keeps_its_first_parks_deadline_when_it_has_late_answers():
    """Park.late: the deadline is the request's first park's, however often it parks again; a
    new request starts its own; past it, None (the server answers ``late``). Without late, each
    park keeps its own deadline."""
    import time

    from tiersync.net.service import Park

    ours, peer = _pair()
    try:
        session = ServerSession(lambda s: None, TcpConfig(), Vocabulary("t", {}, include=(ev.CORE,)), ours, "p", 1)
        first, other, late, now = object(), object(), ("late",), time.monotonic()
        plain = Park(lambda wake: None, now + 5)
        assert session.first_park(first, plain) is plain  # no late answers: as it is
        assert session.first_park(first, Park(plain.watch, now + 5, late)).deadline == now + 5
        again = session.first_park(first, Park(plain.watch, now + 50, late))
        assert again is not None and again.deadline == now + 5 and again.late == late
        assert session.first_park(other, Park(plain.watch, now + 50, late)).deadline == now + 50  # its own
        assert session.first_park(first, Park(plain.watch, now + 60, late)).deadline == now + 60  # asked anew
        soon = time.monotonic() + 1.0
        assert session.first_park(other, Park(plain.watch, soon, late)).deadline == soon
        assert until(lambda: time.monotonic() >= soon)
        assert session.first_park(other, Park(plain.watch, soon + 60, late)) is None  # past its first park's
    finally:
        peer.close()
        ours.close()


def test_a_park_with_no_late_answers_or_a_park_among_them_is_refused_naming_late():
    from tiersync.errors import UsageError
    from tiersync.net.service import Park

    plain = Park(lambda wake: None, 0.0)
    for late in [(), (ev.Pong(1, 1), plain)]:
        with pytest.raises(UsageError, match="late"):
            Park(plain.watch, 0.0, late)


def test_a_held_write_whose_deadline_already_passed_raises_and_ends_the_session():
    """The loop hands a held session to a worker as its ``held_until`` runs out: the write
    raises NetTimeoutError and the session ends there, as for any other failure of a write
    (the caller need not end it)."""
    ours, peer = _pair()
    ended: list[ServerSession] = []
    session = ServerSession(ended.append, TcpConfig(), Vocabulary("t", {}, include=(ev.CORE,)), ours, "peer", 1)
    passed = Deadline(-1.0, "peer")  # ran out a second ago
    try:
        with pytest.raises(NetTimeoutError):
            session.write_or_hold([b"x" * 64], passed)
        assert ended == [session]
    finally:
        peer.close()
        ours.close()
