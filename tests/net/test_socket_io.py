"""``write_nonblocking`` (the server's gather write) on real socket pairs, through the native
``send_all`` and through the pure-Python loop alike: every byte arrives in order, a peer that
stops reading ends the write at its deadline, a peer that left is a PeerClosedError."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import struct
import threading
import time

import numpy as np
import pytest

from _wait import until
from tiersync.net import socket_io
from tiersync.net.errors import NetTimeoutError, PeerClosedError
from tiersync.net.socket_io import Deadline, write_nonblocking

PATHS = ["native", "python"]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    if request.param == "native":
        if socket_io._wire is None:
            pytest.skip("the native extension is not built here")
    else:
        monkeypatch.setattr(socket_io, "_wire", None)
    return request.param


@pytest.fixture()
def pair():
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)  # far under what is written: it fills
    a.setblocking(False)
    yield a, b
    a.close()
    b.close()


def _read_all(sock: socket.socket, n: int, out: bytearray) -> None:
    while len(out) < n:
        chunk = sock.recv(1 << 16)
        if not chunk:
            return
        out += chunk
        time.sleep(0.0005)  # a slow reader: the writer keeps finding the buffer full


def test_every_byte_arrives_in_order(path, pair):
    a, b = pair
    rng = np.random.default_rng(5)
    parts = [
        rng.bytes(100),
        b"",  # an empty part is skipped, not an error
        memoryview(rng.bytes(3 << 20)),
        rng.integers(0, 2**32, 1 << 16, dtype=np.uint32),  # not bytes-formatted: sent as its bytes
        memoryview(bytearray(rng.bytes(70_001)))[1:],
    ]
    expected = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    got = bytearray()
    reader = threading.Thread(target=_read_all, args=(b, len(expected), got))
    reader.start()
    write_nonblocking(a, parts, Deadline(30, "pair"))
    reader.join(30)
    assert bytes(got) == expected


@pytest.mark.parametrize("part", [bytes(16 << 20), np.zeros(4 << 20, np.uint32)], ids=["bytes", "uint32"])
def test_a_peer_that_stops_reading_ends_the_write_at_its_deadline(path, pair, part):
    a, _ = pair
    t0 = time.monotonic()
    with pytest.raises(NetTimeoutError):
        write_nonblocking(a, [b"head", part], Deadline(0.3, "pair"))
    assert 0.25 <= time.monotonic() - t0 < 5


def test_a_peer_that_left_is_a_peer_closed_error(path, pair):
    a, b = pair
    b.close()
    with pytest.raises(PeerClosedError):
        write_nonblocking(a, [bytes(1 << 20)], Deadline(5, "pair"))


@pytest.mark.skipif(socket_io._wire is None, reason="the native extension is not built here")
def test_send_all_counts_exactly_what_was_written_before_its_time_ran_out(pair):
    """``sent`` is exactly the bytes the peer can then read (the caller resumes from there)."""
    a, b = pair
    data = os.urandom(8 << 20)
    sent, err = socket_io._wire.send_all(a.fileno(), [data[: 1 << 20], memoryview(data)[1 << 20 :]], 0.2)
    assert err == -1 and 0 < sent < len(data)  # -1: the time ran out (a TCP ETIMEDOUT is an errno)
    b.setblocking(False)
    got = bytearray()
    while True:
        try:
            chunk = b.recv(1 << 20)
        except BlockingIOError:
            break
        got += chunk
    assert bytes(got) == data[:sent]


@pytest.mark.skipif(socket_io._wire is None, reason="the native extension is not built here")
@pytest.mark.parametrize("bufs", [[b""], [b"ab", b"", b""], [], [b"", memoryview(b"cd")]])
def test_send_all_returns_when_only_empty_buffers_are_left(pair, bufs):
    """A sendmsg of no bytes makes no progress: empty buffers are skipped, never retried."""
    a, b = pair
    done: list[tuple[int, int]] = []
    t = threading.Thread(target=lambda: done.append(socket_io._wire.send_all(a.fileno(), bufs, 5.0)), daemon=True)
    t.start()
    t.join(3)
    total = sum(len(x) for x in bufs)
    assert done == [(total, 0)]
    assert (b.recv(16) if total else b"") == b"".join(bytes(x) for x in bufs)


class _Alarm(Exception):
    pass


def test_a_signal_during_a_blocked_write_runs_its_handler_at_once(path, pair):
    """Ctrl-C (here an interval timer whose handler raises) interrupts a write waiting for room."""
    a, _ = pair

    def handler(signum, frame):
        raise _Alarm

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    t0 = time.monotonic()
    try:
        with pytest.raises(_Alarm):
            write_nonblocking(a, [bytes(16 << 20)], Deadline(20, "pair"))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert time.monotonic() - t0 < 5
    if path == "native":  # part of the frame went out: the socket is shut, no frame can follow it
        b = pair[1]
        b.settimeout(10)
        while b.recv(1 << 20):
            pass


def test_a_socket_closed_under_a_blocked_write_ends_it_and_its_number_reused_gets_nothing(path, pair):
    """Another thread closes the socket a write waits on and a new socket gets its number: the
    write fails (PeerClosedError) and never sends a byte into the new socket."""
    a, b = pair
    failed: list[BaseException] = []

    def write() -> None:
        try:
            write_nonblocking(a, [bytes(16 << 20)], Deadline(20, "pair"))
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            failed.append(exc)

    writer = threading.Thread(target=write)
    writer.start()
    assert select.select([b], [], [], 10)[0]  # the write started: its bytes are arriving
    time.sleep(0.1)  # the send buffer is full: the writer waits for room
    a.shutdown(socket.SHUT_RDWR)
    a.close()
    c, d = socket.socketpair()  # likely given the number the closed socket had
    try:
        writer.join(10)
        assert not writer.is_alive() and len(failed) == 1 and isinstance(failed[0], PeerClosedError)
        d.setblocking(False)
        with pytest.raises(BlockingIOError):
            d.recv(1)
    finally:
        c.close()
        d.close()


def test_a_write_to_a_socket_already_closed_is_a_peer_closed_error(path, pair):
    a, _ = pair
    a.close()  # fileno() is -1 now: no descriptor to write to or to duplicate
    with pytest.raises(PeerClosedError):
        write_nonblocking(a, [b"late"], Deadline(5, "pair"))


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        b = socket.create_connection(listener.getsockname())
        a, _ = listener.accept()
    a.setblocking(False)
    return a, b


@pytest.mark.skipif(socket_io._wire is None, reason="the native extension is not built here")
def test_pinned_buffers_go_by_reference_byte_exact_between_the_copied_ones():
    """``pinned``: large buffers are vmspliced (the peer reads the sender's pages), small ones
    around them copied, in order; a write that fills the socket goes on once the peer reads."""
    a, b = _tcp_pair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)  # far under what is written
    data = np.random.default_rng(3).integers(0, 255, 9 << 20, dtype=np.uint8)
    cut = (3 << 20) + 100
    bufs = [b"head", memoryview(data)[: 3 << 20], b"mid" * 7, memoryview(data)[3 << 20 : cut], data[cut:]]
    want = b"".join(bytes(x) for x in bufs)
    got = bytearray()
    reader = threading.Thread(target=lambda: _read_all(b, len(want), got), daemon=True)
    reader.start()
    try:
        write_nonblocking(a, bufs, Deadline(20, "pair"), pinned=True)
        reader.join(20)
        assert bytes(got) == want
    finally:
        a.close()
        b.close()


def _pipes_usable() -> bool:
    """Whether a pipe of 64 KiB can be had here (else ``send_all`` copies pinned buffers too)."""
    import fcntl

    r, w = os.pipe()
    try:
        with contextlib.suppress(OSError):
            fcntl.fcntl(w, 1031, 1 << 20)  # F_SETPIPE_SZ
        return fcntl.fcntl(w, 1032) >= 64 << 10  # F_GETPIPE_SZ
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.skipif(socket_io._wire is None, reason="the native extension is not built here")
@pytest.mark.parametrize("pinned", [True, False])
def test_a_pinned_buffer_is_read_from_the_senders_pages(pinned):
    """What proves the reference: bytes changed after the write returned, before the peer read,
    reach the peer in the pinned buffer (its pages) and not in the small copied one; without
    ``pinned`` the peer reads the bytes as written."""
    if pinned and not _pipes_usable():
        pytest.skip("no pipe of 64 KiB here (the user's pipe pages are spent): pinned buffers are copied")
    a, b = _tcp_pair()
    small, large = bytearray(b"s" * 100), np.full(192 << 10, 1, np.uint8)  # queued whole, unread
    try:
        write_nonblocking(a, [small, large], Deadline(10, "pair"), pinned=pinned)
        small[:], large[:] = b"S" * 100, 2
        got = bytearray()
        _read_all(b, 100 + large.size, got)
        assert bytes(got[:100]) == b"s" * 100
        assert set(got[100:]) == ({2} if pinned else {1})
    finally:
        a.close()
        b.close()


@pytest.mark.skipif(socket_io._wire is None, reason="the native extension is not built here")
def test_pinned_send_all_counts_exactly_what_was_written_before_its_time_ran_out():
    """By reference too, ``sent`` is exactly the bytes the peer can read: bytes the pipe held
    but the socket did not take are not counted (nor sent)."""
    a, b = _tcp_pair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
    data = np.random.default_rng(4).integers(0, 255, 8 << 20, dtype=np.uint8)
    try:
        sent, err = socket_io._wire.send_all(a.fileno(), [b"h" * 10, memoryview(data)], 0.2, 64 << 10)
        assert err == -1 and 10 < sent < 10 + data.size
        got = bytearray()
        b.settimeout(10)
        _read_all(b, sent, got)  # what the send queue still held arrives too
        b.settimeout(0.5)
        with pytest.raises(TimeoutError):  # and nothing more
            got += b.recv(1 << 20)
        assert bytes(got) == (b"h" * 10 + data.tobytes())[:sent]
    finally:
        a.close()
        b.close()


@pytest.mark.skipif(socket_io._wire is None, reason="the native extension is not built here")
def test_a_blocking_socket_gets_copies_not_references():
    """A splice into a blocking socket would wait past the deadline: there ``pinned`` is ignored."""
    a, b = _tcp_pair()
    a.setblocking(True)
    large = np.full(192 << 10, 1, np.uint8)
    try:
        assert socket_io._wire.send_all(a.fileno(), [large], 10.0, 64 << 10) == (large.size, 0)
        large[:] = 2
        got = bytearray()
        _read_all(b, large.size, got)
        assert set(got) == {1}
    finally:
        a.close()
        b.close()


@pytest.mark.skipif(socket_io._wire is None, reason="the native extension is not built here")
def test_pinned_bytes_copied_for_want_of_a_pipe_still_arrive_and_are_logged_once(caplog, monkeypatch):
    """With no descriptor left for the pipe, pinned buffers are copied: every byte arrives as it
    was written, ``copied_instead`` counts the call, and one warning says so (not one per send)."""
    import resource

    monkeypatch.setattr(socket_io, "_copies_noted", [False])
    a, b = _tcp_pair()
    large = np.full(192 << 10, 1, np.uint8)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    spare: list[int] = []
    before = socket_io._wire.copied_instead()
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 64, hard))
        with contextlib.suppress(OSError):
            while len(spare) < 4096:
                spare.append(os.dup(b.fileno()))
        os.close(spare.pop())  # one left: send_all's own hold on the socket takes it, the pipe gets none
        with caplog.at_level("WARNING", logger="tiersync.net.socket_io"):
            for _ in range(2):
                write_nonblocking(a, [large], Deadline(10, "pair"), pinned=True)
                large[:] = 2  # copied: the peer reads what was written
                got = bytearray()
                _read_all(b, large.size, got)
                assert set(got) == {1}
                large[:] = 1
        assert socket_io._wire.copied_instead() == before + 2
        assert len(caplog.records) == 1 and "pipe-user-pages-soft" in caplog.records[0].message
    finally:
        for fd in spare:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        a.close()
        b.close()


@pytest.mark.skipif(socket_io._wire is None, reason="the native extension is not built here")
def test_the_native_calls_read_the_sockets_number_themselves():
    """``send_all`` and ``recv_many`` take the socket object and duplicate its descriptor as they
    read it (no window in which another thread's close and accept could hand that number to a
    new connection); a closed socket is EBADF, not a write to whatever holds number -1."""
    import errno

    a, b = _tcp_pair()
    try:
        assert socket_io._wire.send_all(a, [b"hello"], 5.0) == (5, 0)
        got = bytearray()
        _read_all(b, 5, got)
        assert bytes(got) == b"hello"
        a.close()
        for call in (
            lambda: socket_io._wire.send_all(a, [b"x"], 1.0),
            lambda: socket_io._wire.recv_many(a, memoryview(bytearray(64)), [bytearray(8)], [1], 64, 0, 1.0),
        ):
            with pytest.raises(OSError) as info:
                call()
            assert info.value.errno == errno.EBADF
    finally:
        a.close()
        b.close()


def test_peer_gone_sees_a_hang_up_behind_unread_bytes_and_a_reset():
    from tiersync.net.socket_io import peer_gone

    with socket.create_server(("127.0.0.1", 0)) as listener:
        for how in ("close", "reset"):
            peer = socket.create_connection(listener.getsockname())
            ours, _ = listener.accept()
            with ours:
                assert not peer_gone(ours)
                peer.sendall(b"unread request bytes")
                if how == "reset":
                    peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                peer.close()
                assert until(lambda s=ours: peer_gone(s)), how
                if how == "close":
                    assert ours.recv(64) == b"unread request bytes"  # the bytes were left where they were
            assert peer_gone(ours)  # closed under us
