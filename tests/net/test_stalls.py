"""tiersync.net.stalls: unfinished frames alone, then a real server ending a peer that stops mid-frame."""

from __future__ import annotations

import socket
import threading

from tiersync.net import events as ev
from tiersync.net.config import TcpConfig
from tiersync.net.source import MemoryBlockSource
from tiersync.net.stalls import Stalls
from tiersync.net.tcp import TcpTransport

TOKEN = b"stalls-test-token-0123456789"


def test_a_frame_unfinished_for_limit_s_is_named_once():
    stalls: Stalls[str] = Stalls(10.0)
    stalls.note("s", True, 100.0)
    stalls.note("s", True, 105.0)  # the same frame: its clock keeps running
    assert stalls.expired(109.9) == []
    assert stalls.expired(110.0) == ["s"] and stalls.expired(200.0) == [] and len(stalls) == 0


def test_a_session_between_frames_or_handed_to_a_worker_is_no_stall():
    stalls: Stalls[str] = Stalls(10.0)
    stalls.note("finished", True, 100.0)
    stalls.note("finished", False, 101.0)  # its frame completed: at a boundary now
    stalls.note("worker", True, 100.0)
    stalls.clear("worker")
    stalls.note("again", True, 100.0)
    stalls.note("again", False, 101.0)
    stalls.note("again", True, 105.0)  # a new frame: a new clock
    assert stalls.expired(112.0) == []
    assert stalls.expired(115.0) == ["again"]


def test_a_server_ends_a_peer_that_stops_mid_frame_and_keeps_one_idle_between_frames():
    """op_timeout_s 0.5: an authenticated peer that sent ten bytes of a frame header and nothing
    more is closed (it held its bytes and its connection slot for good); one that waits
    between two requests longer than that is still served."""
    cfg = TcpConfig(token=TOKEN, op_timeout_s=0.5)
    server = TcpTransport(cfg).serve("127.0.0.1:0", MemoryBlockSource({}))
    transport = TcpTransport(TcpConfig(token=TOKEN))
    stuck, idle = transport.connect(server.address), transport.connect(server.address)
    try:
        assert idle.request(ev.Ping(idle.new_request_id(), 1), timeout=5).token == 1
        sock: socket.socket = stuck._framed.sock
        sock.sendall(b"TSYN\x01\x00\x00\x00\x00\x00")  # part of a header
        sock.settimeout(10)
        assert sock.recv(1) == b""  # closed by the server, within op_timeout_s and a loop turn
        threading.Event().wait(1.5)  # idle between frames for three op_timeout_s
        assert idle.request(ev.Ping(idle.new_request_id(), 2), timeout=5).token == 2
        assert server.connections == 1
    finally:
        stuck.close()
        idle.close()
        server.close()
