"""The one server under hostile peers: floods of idle and unauthenticated connections,
descriptor exhaustion, the connection cap, and sessions that end while holding leases.

Each node runs in its own process (``_node_child.py``); the test measures that process's
RSS and descriptors through /proc.
"""

from __future__ import annotations

import contextlib
import enum
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import ClassVar

import pytest

from tiersync.errors import RemoteError
from tiersync.net import store_ops as so
from tiersync.net.codec import MetaReader, MetaWriter
from tiersync.net.errors import AuthError, PeerClosedError, RequestError
from tiersync.net.events import CORE, Ping, Pong
from tiersync.net.service import Service
from tiersync.net.store_node import StoreNodeClient
from tiersync.net.tcp import TcpConfig, TcpTransport
from tiersync.net.vocab import Vocabulary

HERE = os.path.dirname(__file__)
TOKEN = b"server-test-token-0123456789"
FLOOD = 10_000
RSS_GROWTH_BOUND = 200 << 20  # what 10,000 half-open connections may add to the node's RSS


def _start(cap: int, nofile: int = 0) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "_node_child.py"), str(cap), str(nofile)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    return proc, proc.stdout.readline().strip()


def _stop(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    proc.wait(timeout=30)


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _until(predicate, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _write_block(address: str, key: bytes, data: bytes) -> None:
    StoreNodeClient(address, token=TOKEN, timeout=30).offer_and_push([key], [data])


def _read_block(address: str, key: bytes, size: int) -> bytes:
    out = bytearray(size)
    StoreNodeClient(address, token=TOKEN, timeout=30).read([key], [out])
    return bytes(out)


@pytest.fixture()
def many_fds():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = FLOOD + 512
    if hard < need:
        pytest.skip(f"needs {need} descriptors, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.slow
def test_ten_thousand_idle_and_unauthenticated_connections_do_not_stop_service(many_fds):
    proc, address = _start(cap=FLOOD + 100)
    host, port = address.rsplit(":", 1)
    try:
        data = os.urandom(1 << 20)
        _write_block(address, b"K" * 16, data)
        base_rss, base_fds = _rss(proc.pid), _fds(proc.pid)
        socks, reads, errors = [], [], []
        stop = threading.Event()

        def reader() -> None:  # an authenticated client, served byte-exact throughout the flood
            while not stop.is_set():
                try:
                    reads.append(_read_block(address, b"K" * 16, len(data)) == data)
                except Exception as exc:  # noqa: BLE001 - recorded and asserted below
                    errors.append(exc)

        t = threading.Thread(target=reader)
        t.start()
        for i in range(FLOOD):
            s = socket.create_connection((host, int(port)), timeout=10)
            if i % 2:  # half send garbage that is not a frame header yet (a slow-loris HELLO)
                s.send(b"TSYN\x03\x00")
            socks.append(s)
        assert _until(lambda: len(reads) >= 3, 30)
        peak = _rss(proc.pid)
        stop.set()
        t.join(timeout=60)
        for s in socks:
            s.close()
        assert not errors and reads and all(reads)
        assert peak - base_rss < RSS_GROWTH_BOUND, (peak - base_rss) >> 20
        assert _until(lambda: _fds(proc.pid) <= base_fds, 30), (_fds(proc.pid), base_fds)
        assert _read_block(address, b"K" * 16, len(data)) == data
    finally:
        _stop(proc)


def _closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    sock.settimeout(timeout)
    try:
        return sock.recv(1 << 16) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def test_an_unauthenticated_peer_cannot_make_the_node_buffer_a_large_frame():
    """100 peers each declare a HELLO with 1 MiB of metadata (a valid header: its checksum is
    anyone's to compute) and send all of it but the last byte: the node refuses each from the
    header alone (a handshake frame is at most a few KiB), well before its 5 s handshake
    deadline, instead of buffering 100 MiB."""
    from tiersync.net.frames import EMPTY_CHECKSUM, SUPPORTED, Op, encode_header

    proc, address = _start(cap=1000)
    host, port = address.rsplit(":", 1)
    meta = bytes((1 << 20) - 1)
    wire = encode_header(Op.HELLO, 0, meta, 0, EMPTY_CHECKSUM[SUPPORTED[0]], SUPPORTED[0]) + meta[:-1]
    socks = []
    try:
        base = _rss(proc.pid)
        for _ in range(100):
            s = socket.create_connection((host, int(port)), timeout=10)
            socks.append(s)
            try:
                s.sendall(wire)
            except OSError:  # the node closed it while the metadata was on its way
                pass
        grown = _rss(proc.pid) - base
        assert _closed_by_peer(socks[0], 2.0) and _closed_by_peer(socks[-1], 2.0)  # not at the 5 s deadline
        assert grown < 8 << 20, grown >> 20  # 0 here; 25 MiB and growing without the bound
        assert _read_block_after_write(address) == b"ok"
    finally:
        for s in socks:
            s.close()
        _stop(proc)


def _read_block_after_write(address: str) -> bytes:
    data = os.urandom(4096)
    _write_block(address, b"H" * 16, data)
    return b"ok" if _read_block(address, b"H" * 16, len(data)) == data else b"differs"


def test_connections_over_the_cap_are_refused_with_a_clear_error():
    """Four authenticated sessions fill a cap of 4: a fifth connection is refused saying so.
    Four silent ones fill it instead: a client gets in, the oldest of them is ended for it."""
    proc, address = _start(cap=4)
    host, port = address.rsplit(":", 1)
    sessions = [TcpTransport(TcpConfig(token=TOKEN)).connect(address, timeout=5) for _ in range(4)]
    silent = []
    try:
        with pytest.raises(PeerClosedError, match="too many connections"):
            TcpTransport(TcpConfig(token=TOKEN)).connect(address, timeout=5)
        for ch in sessions:
            ch.close()
        data = os.urandom(4096)
        assert _until(lambda: _try_write(address, data), 20)
        silent = [socket.create_connection((host, int(port))) for _ in range(4)]
        assert _read_block(address, b"C" * 16, len(data)) == data  # in, though 4 silent ones came first
        assert _closed_by_peer(silent[0], 5.0)  # the oldest silent one made room, before its deadline
    finally:
        for s in silent:
            s.close()
        _stop(proc)


def _try_write(address: str, data: bytes) -> bool:
    try:
        _write_block(address, b"C" * 16, data)
        return True
    except PeerClosedError:
        return False


def test_accept_out_of_descriptors_backs_off_and_recovers():
    proc, address = _start(cap=10_000, nofile=48)
    host, port = address.rsplit(":", 1)
    try:
        socks = [socket.create_connection((host, int(port)), timeout=10) for _ in range(120)]  # past 48 fds
        assert _until(lambda: _fds(proc.pid) >= 46, 10)
        for s in socks:
            s.close()
        data = os.urandom(64 << 10)
        assert _until(lambda: _try_write_k(address, data), 30)
        assert _read_block(address, b"E" * 16, len(data)) == data
        assert proc.poll() is None
    finally:
        _stop(proc)


def test_silent_peers_filling_a_descriptor_table_smaller_than_the_cap_do_not_keep_a_client_out():
    """The node's descriptor table (48) is far below its connection cap (10,000): silent peers
    that fill it used to keep every new client in the listen backlog until their handshake
    deadlines (5 s) passed. Out of descriptors, the node now ends the oldest connection still in
    its handshake for the next one (none in its first 0.25 s): a client gets in while they stay
    open and reconnect, and pulls its block byte-exact over the socket (a write, for which the
    node connects to the writer, and a same-host read need descriptors of their own)."""
    with _flooded_node() as (proc, address, data, _):
        channel = TcpTransport(TcpConfig(token=TOKEN, connect_timeout_s=2.0)).connect(address, timeout=2.0)
        assert channel.request(Ping(channel.new_request_id(), 7), timeout=2).token == 7
        lease = channel.request(so.ReadLease(channel.new_request_id(), (b"G" * 16,)), timeout=5)
        got = bytearray(len(data))
        channel.request(so.Pull(channel.new_request_id(), lease.lease_id, b"G" * 16, 0, len(data)), into=got, timeout=5)
        assert got == data
        channel.close()
        assert proc.poll() is None


def test_out_of_descriptors_a_same_host_read_releases_and_a_write_is_stored():
    """During the flood of the test above, a same-host read (its lease released at the end) is
    answered byte-exact: the release used to fail INTERNAL (the allocator's first ``np.unique``
    imports numpy.ma, a file to open), leaving the blocks pinned until the lease's TTL. A write
    is stored too: the node dials the writer with the descriptor it keeps in reserve (it used
    to fail EMFILE). A write that still fails (its spare not yet taken back) frees its landing
    blocks and keys: after the flood, that key is written and the node's 16 blocks all take a
    write."""
    with _flooded_node() as (proc, address, data, end_flood):
        assert _read_block(address, b"G" * 16, len(data)) == data  # the release is COMMITTED, or it raises
        _write_block(address, b"V" * 16, data)  # the node dials us with its spare descriptor
        assert _read_block(address, b"V" * 16, len(data)) == data
        with contextlib.suppress(RemoteError):  # a second dial at once may find no descriptor
            _write_block(address, b"W" * 16, data)
        end_flood()
        for i in range(14):  # every block but G's and V's: none may still be landing or leaked
            _write_block(address, b"W" * 15 + bytes([i]) if i else b"W" * 16, os.urandom(1 << 20))
        assert _read_block(address, b"G" * 16, len(data)) == data
        assert proc.poll() is None


@contextlib.contextmanager
def _flooded_node():
    """A node with 48 descriptors holding block G (64 KiB), its table kept full by about 120
    silent peers: yields (process, address, G's bytes, a function that ends the flood)."""
    proc, address = _start(cap=10_000, nofile=48)
    host, port = address.rsplit(":", 1)
    stop, silent = threading.Event(), []
    data = os.urandom(64 << 10)
    _write_block(address, b"G" * 16, data)
    flooder = threading.Thread(target=_flood, args=(host, int(port), stop, silent), daemon=True)

    def end_flood() -> None:
        stop.set()
        flooder.join(10)
        for s in silent:
            s.close()

    try:
        flooder.start()
        assert _until(lambda: _fds(proc.pid) >= 46, 10)
        yield proc, address, data, end_flood
    finally:
        end_flood()
        _stop(proc)


def _flood(host: str, port: int, stop: threading.Event, silent: list[socket.socket]) -> None:
    """Keep about 120 silent connections open until ``stop``, reopening those the node ended."""
    while not stop.is_set():
        silent[:] = [s for s in silent if s.fileno() != -1 and not _hung_up(s)]
        while len(silent) < 120:
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex((host, port))
            silent.append(s)
        stop.wait(0.02)


def _hung_up(s: socket.socket) -> bool:
    try:
        return s.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_a_session_open_before_the_descriptors_ran_out_is_still_answered():
    """The node's native writes hold the socket by a duplicate descriptor; with none left (a
    flood of plain connections filled the table) an answer used to end the session (and its
    leases) with EMFILE. It now goes out by the socket's own number: the reader open before
    the flood pulls its leased block during the flood, byte-exact."""
    proc, address = _start(cap=10_000, nofile=48)
    host, port = address.rsplit(":", 1)
    data = os.urandom(64 << 10)
    try:
        _write_block(address, b"F" * 16, data)
        channel = TcpTransport(TcpConfig(token=TOKEN)).connect(address)
        lease = channel.request(so.ReadLease(channel.new_request_id(), (b"F" * 16,)))
        got = bytearray(len(data))
        channel.request(so.Pull(channel.new_request_id(), lease.lease_id, b"F" * 16, 0, len(data)), into=got)
        socks = [socket.create_connection((host, int(port)), timeout=10) for _ in range(120)]  # past 48 fds
        assert _until(lambda: _fds(proc.pid) >= 46, 10)
        got = bytearray(len(data))
        pull = so.Pull(channel.new_request_id(), lease.lease_id, b"F" * 16, 0, len(data))
        channel.request(pull, into=got, timeout=10)
        assert got == data
        for s in socks:
            s.close()
        channel.close()
    finally:
        _stop(proc)


def test_a_reader_with_no_descriptor_left_still_reads_and_writes():
    """The reader's own process is out of descriptors (its native calls cannot hold the socket
    by a duplicate): its requests and the DATA it reads go by the socket's own number, byte-exact."""
    proc, address = _start(cap=100)
    data = os.urandom(256 << 10)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    spare: list[int] = []
    try:
        _write_block(address, b"G" * 16, data)
        channel = TcpTransport(TcpConfig(token=TOKEN)).connect(address)
        lease = channel.request(so.ReadLease(channel.new_request_id(), (b"G" * 16,)))
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 64, hard))
        with contextlib.suppress(OSError):
            while len(spare) < 4096:
                spare.append(os.dup(0))
        got = bytearray(len(data))
        view = memoryview(got)
        items = [(b"G" * 16, off, view[off : off + (64 << 10)]) for off in range(0, len(data), 64 << 10)]
        channel.pull_many(lease.lease_id, items, window=4, timeout=10)
        assert got == data
        channel.close()
    finally:
        for fd in spare:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        _stop(proc)


def _try_write_k(address: str, data: bytes) -> bool:
    try:
        _write_block(address, b"E" * 16, data)
        return True
    except Exception:  # noqa: BLE001 - refused while descriptors are short
        return False


def test_a_wrong_token_is_refused_and_counted():
    proc, address = _start(cap=100)
    try:
        with pytest.raises(AuthError):
            TcpTransport(TcpConfig(token=b"not-the-right-token-at-all")).connect(address, timeout=5)
        with pytest.raises(AuthError):
            TcpTransport(TcpConfig()).connect(address, timeout=5)
    finally:
        _stop(proc)


def test_a_reader_that_disconnects_mid_read_leaves_no_lease():
    from tiersync.net.store_node import StoreNode, StoreNodeServer

    node = StoreNode(4 << 20, 1 << 20, config=TcpConfig(token=TOKEN))
    server = StoreNodeServer("127.0.0.1:0", node)
    try:
        data = os.urandom(1 << 20)
        _write_block(server.address, b"L" * 16, data)
        channel = TcpTransport(TcpConfig(token=TOKEN)).connect(server.address)
        lease = channel.request(so.ReadLease(channel.new_request_id(), (b"L" * 16,)))
        assert lease.status is so.LeaseStatus.GRANTED and node.active_leases == 1
        channel.close()  # killed before RELEASE
        assert _until(lambda: node.active_leases == 0 and node.session_leases() == 0, 10)
        assert node.arena.allocator.num_free == node.arena.num_blocks - 1  # the block itself stays stored
    finally:
        server.close()
        node.close()


def test_an_error_frame_before_the_handshake_ends_that_connection_not_the_server():
    """An unauthenticated ERROR frame with a request id other than 0 once made the handshake
    answer on a closed connection, and the ClosedError ended the server's loop for good."""
    from tiersync.net import events as ev
    from tiersync.net.frames import EMPTY_CHECKSUM, SUPPORTED, Op, encode_header

    proc, address = _start(cap=100)
    host, port = address.rsplit(":", 1)
    try:
        meta = ev.Error(5, ev.ErrorCode.INTERNAL, "x").meta()
        for rid in (5, 0):
            s = socket.create_connection((host, int(port)), timeout=10)
            s.sendall(encode_header(Op.ERROR, rid, meta, 0, EMPTY_CHECKSUM[SUPPORTED[0]], SUPPORTED[0]) + meta)
            assert _closed_by_peer(s, 2.0)
            s.close()
        assert _read_block_after_write(address) == b"ok"  # the node still serves
    finally:
        _stop(proc)


class _OddOp(enum.IntEnum):
    ODD = 63


@dataclass(frozen=True, slots=True)
class _Odd:
    """A request whose metadata parse raises RecursionError for ``what == 1`` (as JSON nested
    too deep does) and whose handler fails with a bug for ``what == 2``."""

    OP: ClassVar[_OddOp] = _OddOp.ODD
    request_id: int
    what: int

    def meta(self) -> bytes:
        return MetaWriter().u64(self.what).getvalue()

    @classmethod
    def parse(cls, rid: int, r: MetaReader, cfg: object) -> _Odd:
        what = r.u64()
        if what == 1:
            raise RecursionError("maximum recursion depth exceeded")
        return cls(rid, what)


class _OddService(Service):
    vocabulary = Vocabulary("odd", {_Odd: (Pong,)}, include=(CORE,))

    def __init__(self) -> None:
        self.ended = threading.Semaphore(0)

    def handle(self, session, event):
        if isinstance(event, _Odd) and event.what == 2:
            return self._bug()
        return [Pong(event.request_id, 0)]

    def _bug(self):
        raise RuntimeError("a handler bug")
        yield  # a generator: its body runs while the answers are written

    def closed(self, session) -> None:
        self.ended.release()


def test_a_request_no_parser_or_handler_foresaw_ends_its_session_not_the_server():
    service = _OddService()
    transport = TcpTransport(TcpConfig(token=TOKEN), _OddService.vocabulary)
    server = transport.serve("127.0.0.1:0", service)
    try:
        for what in (1, 2):  # the first request of a session is parsed on the loop thread, later ones on a worker
            for first in (True, False):
                channel = transport.connect(server.address)
                if not first:
                    assert isinstance(channel.request(_Odd(channel.new_request_id(), 0)), Pong)
                with pytest.raises((PeerClosedError, RequestError)):
                    channel.request(_Odd(channel.new_request_id(), what), timeout=10)
                channel.close()
                assert service.ended.acquire(timeout=10)  # the session ended: its service was told
        channel = transport.connect(server.address)
        assert isinstance(channel.request(_Odd(channel.new_request_id(), 0)), Pong)  # still serving
        channel.close()
    finally:
        server.close()
