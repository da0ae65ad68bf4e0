"""A socket plus a sans-IO :class:`~tiersync.net.protocol.Connection`, under deadlines.

:class:`FramedSocket` writes events and reads events for both sides of the TCP transport
(:mod:`tiersync.net.tcp` builds channels and servers on it); :class:`Deadline` bounds every
blocking call, and socket errors become the RemoteError family, naming the peer.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, NoReturn, cast

from tiersync.iov import consume
from tiersync.net.errors import AuthError, NetTimeoutError, PeerClosedError
from tiersync.net.frames import EMPTY_META_CHECKSUM, HEADER_SIZE, SUPPORTED, PayloadChecksum
from tiersync.net.pieces import byte_views
from tiersync.net.protocol import NEED_DATA, Connection
from tiersync.net.socket_users import SocketUsers, in_use

if TYPE_CHECKING:
    from types import TracebackType

    from tiersync.net.config import TcpConfig
    from tiersync.net.events import Event

__all__ = ["Deadline", "FramedSocket", "io_errors", "peer_gone", "peer_ip", "tune", "write_nonblocking", "write_within"]

try:  # the receive fast path (GIL released); without it every frame takes the reference path
    from tiersync.net import _wire
except ImportError:  # pragma: no cover - depends on the build
    _wire = None  # type: ignore[assignment]  # an optional compiled module: mypy cannot type it "or None"
if PayloadChecksum.TSUM64 not in SUPPORTED:  # pragma: no cover - the fallback must verify what it accepts
    _wire = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

_IOV_MAX = 1024
_DEADLINE = -1  # _wire.send_all's err when the time ran out
_NO_DESCRIPTOR = (errno.EMFILE, errno.ENFILE)  # the native calls could not hold the socket's descriptor
_PINNED = 64 << 10  # pinned buffers of at least this many bytes go by reference (smaller: copied)
_ESTABLISHED = 1  # tcpi_state of a connection neither end has closed (linux/tcp_states.h)
_PIECE = 4 << 20  # most bytes one recv lands in a payload before the checksum reads them
_SLACK = 0.05  # re-arm a kernel timeout once it is off by more than this share of what is left
_TIMEVAL = struct.Struct("@ll")


class Deadline:
    """Absolute deadline for one operation against ``peer``."""

    __slots__ = ("_end", "_timeout", "peer")

    def __init__(self, timeout: float, peer: str) -> None:
        self._timeout, self.peer = timeout, peer
        self._end = time.monotonic() + timeout

    def left(self) -> float:
        """Seconds left (<= 0 once it passed)."""
        return self._end - time.monotonic()

    def remaining(self) -> float:
        """Seconds left; raises NetTimeoutError when none are."""
        left = self._end - time.monotonic()
        if left <= 0:
            raise NetTimeoutError("operation timed out", peer=self.peer, timeout_s=self._timeout)
        return left

    def within(self, seconds: float | None) -> Deadline:
        """This deadline, or one ``seconds`` from now where that comes first (None: this one)."""
        if seconds is None or seconds >= self.remaining():
            return self
        return Deadline(seconds, self.peer)


def write_nonblocking(
    sock: socket.socket, bufs: Sequence[bytes | memoryview], deadline: Deadline, *, pinned: bool = False
) -> None:
    """:func:`write_within`, all of it: NetTimeoutError when ``deadline`` passed first."""
    if write_within(sock, bufs, deadline, pinned=pinned):
        deadline.remaining()  # passed: raises


def write_within(
    sock: socket.socket, bufs: Sequence[bytes | memoryview], deadline: Deadline, *, pinned: bool = False
) -> list[memoryview]:
    """Write ``bufs`` to a non-blocking socket (plain or TLS), waiting for room with poll until
    ``deadline``: what is left then (empty: all written). ``pinned``: the large buffers' bytes
    stay unchanged until the peer read them (:attr:`~tiersync.net.events.Data.pinned`), so on a
    plain socket they go by reference (vmsplice and splice: no copy into the kernel). Raises
    PeerClosedError, AuthError (TLS)."""
    tls = isinstance(sock, ssl.SSLSocket)
    if _wire is not None and not tls:
        left = _send_native(sock, list(bufs), deadline, _PINNED if pinned else 0, keep=True)
        if pinned:
            _note_copies()
        if left is None:
            return []
        bufs = left  # no descriptor to hold (or the deadline passed): the rest goes by the socket's own number
    views = [memoryview(b).cast("B") for b in bufs if len(b)]
    with io_errors(deadline.peer):
        while views:
            try:
                consume(views, sock.send(views[0]) if tls else sock.sendmsg(views[:_IOV_MAX]))
            except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                if deadline.left() <= 0:
                    return views
                poller = select.poll()
                poller.register(sock, select.POLLOUT)
                poller.poll(max(1, int(deadline.left() * 1000)))
    return []


def _send_native(
    sock: socket.socket, bufs: list[bytes | memoryview], deadline: Deadline, pinned: int = 0, *, keep: bool = False
) -> list[bytes | memoryview] | None:
    """:func:`write_within` in one GIL-free call per deadline check (plain sockets); None once
    sent, or what is left when the process has no descriptor to hold the socket by (the
    call's first step: a flood of connections must not end the sessions already open), or,
    ``keep``, once the deadline passed (else NetTimeoutError)."""
    while True:
        if keep and deadline.left() <= 0:
            return bufs
        try:
            sent, err = _wire.send_all(sock, bufs, deadline.remaining(), pinned)  # its number read by the call
        except OSError as exc:  # the socket was closed (EBADF) or no descriptor is left (EMFILE)
            if exc.errno in _NO_DESCRIPTOR:
                return bufs
            _raise_io(exc, deadline.peer)
        if not err:
            return None
        if err != _DEADLINE:  # a TCP ETIMEDOUT is the peer's failure, not our deadline
            _raise_io(OSError(err, os.strerror(err)), deadline.peer)
        rest: list[bytes | memoryview] = [*consume(byte_views(bufs), sent)]  # the deadline decides next turn
        bufs = rest


_copies_noted = [False]


def _note_copies() -> None:
    """Log once per process that pinned bytes were copied after all (the process, or the user
    it runs as, has no pipe pages or descriptors left: ``fs.pipe-user-pages-soft``, ``ulimit
    -n``): sends still work, at the CPU cost of a copy."""
    if not _copies_noted[0] and _wire.copied_instead():
        _copies_noted[0] = True
        log.warning(
            "pinned sends are being copied: no pipe of 64 KiB could be had (fs.pipe-user-pages-soft "
            "spent by this user, or no file descriptor left); they still go out, with one more copy"
        )


def peer_gone(sock: socket.socket) -> bool:
    """Whether the peer of TCP socket ``sock`` (plain or TLS) hung up, FIN or RST, even with
    bytes of it still unread: the connection is no longer ESTABLISHED (``TCP_INFO``)."""
    try:
        return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] != _ESTABLISHED
    except OSError:  # closed under us
        return True


def peer_ip(sock: socket.socket) -> str:
    """The IP ``sock`` is connected to ("" once it no longer is)."""
    try:
        return str(sock.getpeername()[0])
    except OSError:
        return ""


def tune(sock: socket.socket, cfg: TcpConfig) -> None:
    """Apply buffer sizes, TCP_NODELAY and keepalive (``keepalive_s``: probes from half of it
    on, every eighth, four unanswered ones end the connection; and sent bytes unacknowledged
    for that long end it too: the last answer sent to a peer that went away stays unacked,
    and then retransmissions, not probes, ran for about 15 minutes)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, cfg.sndbuf)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, cfg.rcvbuf)
    if cfg.nodelay:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if cfg.keepalive_s:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, max(1, round(cfg.keepalive_s / 2)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, round(cfg.keepalive_s / 8)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 4)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, round(cfg.keepalive_s * 1000))


class FramedSocket:
    """A socket plus a sans-IO :class:`Connection`: writes events, reads events.

    Plain TCP runs the socket in blocking mode with kernel timeouts (SO_RCVTIMEO /
    SO_SNDTIMEO) re-armed only when the deadline has moved by more than ``_SLACK``
    of what is left, so one recv or sendmsg is one syscall (no poll, no ioctl); with the
    native extension a write is one GIL-free ``send_all`` (MSG_DONTWAIT, poll for room). While a
    payload buffer is registered, a frame starts with one scatter read (``recvmsg_into``)
    of the header plus the buffer the next DATA should land in (a pipelined answer that
    already arrived whole takes one syscall), and the rest of a payload comes with
    MSG_WAITALL straight into the buffer, in pieces of ``_PIECE`` so the checksum reads
    them while they are still in cache. TLS sockets use Python timeouts, no scatter.
    """

    def __init__(self, sock: socket.socket, conn: Connection, peer: str, cfg: TcpConfig) -> None:
        self.sock, self.conn, self.peer, self.cfg = sock, conn, peer, cfg
        self.lock = threading.Lock()  # the Connection's state: one reader and one writer may run at once
        self._rbuf = bytearray(cfg.recv_chunk)
        self._rview = memoryview(self._rbuf)
        self._hview = memoryview(bytearray(HEADER_SIZE))
        self._tls = isinstance(sock, ssl.SSLSocket)
        self._armed = {socket.SO_RCVTIMEO: 0.0, socket.SO_SNDTIMEO: 0.0}
        self._users = SocketUsers(sock, peer)
        if not self._tls:
            sock.settimeout(None)

    def quiet(self) -> bool:
        """Whether nothing is there to read and the peer has not hung up (an idle connection
        whose peer restarted, timed it out or sent stray bytes is not handed out again)."""
        poller = select.poll()
        try:
            poller.register(self.sock, select.POLLIN | select.POLLPRI)  # POLLHUP and POLLERR come anyway
            if not poller.poll(0) and not (self._tls and cast(ssl.SSLSocket, self.sock).pending()):
                return True
            if self._tls:  # TLS records alone (a late session ticket) are no bytes of the peer's
                self.sock.settimeout(0)  # the next operation arms its own timeout
                self.sock.recv(1)
        except ssl.SSLWantReadError:
            return True
        except (OSError, ValueError):  # closed under us, reset, or a TLS alert
            pass
        return False

    def _arm(self, which: int, deadline: Deadline) -> None:
        """Bound the next blocking call by the deadline (raises NetTimeoutError when it passed)."""
        left = deadline.remaining()
        if self._tls:
            self.sock.settimeout(left)
            return
        armed = self._armed[which]
        if armed > left * (1 + _SLACK) + 0.001 or armed < left * (1 - _SLACK):
            sec = int(left)
            self.sock.setsockopt(socket.SOL_SOCKET, which, _TIMEVAL.pack(sec, max(1, int((left - sec) * 1e6))))
            self._armed[which] = left

    def write(self, event: Event, deadline: Deadline) -> None:
        with self.lock:
            bufs = self.conn.send(event)
        self.send_buffers(bufs, deadline)

    @in_use
    def send_buffers(self, bufs: Sequence[bytes | memoryview], deadline: Deadline) -> None:
        """Write encoded frames (``Connection.send`` output, possibly several concatenated)."""
        if _wire is not None and not self._tls:  # MSG_DONTWAIT and poll: no kernel timeout to arm
            left = _send_native(self.sock, list(bufs), deadline)
            if left is None:
                return
            bufs = left  # no descriptor to hold: the rest by the socket's own number
        views = cast("list[memoryview]", [b for b in bufs if len(b)])  # headers are bytes: consume slices them alike
        try:
            while views:
                self._arm(socket.SO_SNDTIMEO, deadline)
                if self._tls:  # SSLSocket has no sendmsg
                    self.sock.sendall(views.pop(0))
                    continue
                try:
                    consume(views, self.sock.sendmsg(views[:_IOV_MAX]))
                except BlockingIOError:  # the kernel timeout fired; _arm decides if the deadline did
                    continue
        except NetTimeoutError:
            raise
        except OSError as exc:
            _raise_io(exc, self.peer)

    @in_use
    def read(self, deadline: Deadline) -> object:
        """Next event (or ConnectionClosed); receives payloads into registered sinks."""
        conn = self.conn
        try:
            while True:
                with self.lock:
                    event = conn.next_event()
                if event is not NEED_DATA:
                    return event
                self._arm(socket.SO_RCVTIMEO, deadline)
                try:
                    self._recv_once()
                except BlockingIOError:
                    continue
        except NetTimeoutError:
            raise
        except OSError as exc:
            _raise_io(exc, self.peer)

    @in_use
    def read_data(self, request_ids: Sequence[int], deadline: Deadline) -> list[object]:
        """The next events where the next frames should be the DATA answers to ``request_ids``, in
        order: at least one event, at most one per id. With the native receiver (plain TCP) one
        GIL-free call lands consecutive frames in their registered buffers and verifies each as the
        parser would (:meth:`Connection.data_fast_received`); the first frame it did not verify goes
        to the reference parser (:meth:`Connection.scatter_received`), whose event ends the list."""
        conn = self.conn
        out: list[object] = []
        if _wire is None or self._tls:
            return [self.read(deadline)]
        try:
            while len(out) < len(request_ids) and (dests := conn.data_fast_targets(request_ids[len(out) :])):
                self._arm(socket.SO_RCVTIMEO, deadline)
                rids = list(request_ids[len(out) : len(out) + len(dests)])
                sock, limit, left = self.sock, conn.config.max_frame_size, deadline.remaining()
                try:  # stops starting reads at the deadline: the parser then takes what landed
                    done, sums, n, err = _wire.recv_many(
                        sock, self._hview, dests, rids, limit, EMPTY_META_CHECKSUM, left
                    )
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as exc:
                    if exc.errno in _NO_DESCRIPTOR:  # nothing read: the parser reads by the socket's number
                        break
                    raise
                out += [conn.data_fast_received(rid, value) for rid, value in zip(rids, sums)]
                if done < len(dests) and not err:
                    conn.scatter_received(self._hview, n)  # n == 0: end of stream
                    break
        except NetTimeoutError:
            raise
        except OSError as exc:
            _raise_io(exc, self.peer)
        if len(out) < len(request_ids):  # the parser's turn: a frame the native receiver did not take
            out.append(self.read(deadline))
        return out

    def _recv_once(self) -> None:
        """One recv, fed to the connection: into the payload being received, else header plus
        the next expected payload in one scatter read, else into the read buffer."""
        conn, sock = self.conn, self.sock
        sinks = conn.payload_sinks()
        if len(sinks) > 1 and not self._tls:  # a vectored pull: the rest of its ranges in one scatter read
            n = sock.recvmsg_into(sinks[:_IOV_MAX], 0, socket.MSG_WAITALL)[0]
            return conn.payload_received(n) if n else conn.receive_data(b"")
        sink = sinks[0] if sinks else None
        if sink is not None:
            if self._tls:
                n = sock.recv_into(sink)
            else:
                n = sock.recv_into(sink[:_PIECE] if len(sink) > _PIECE else sink, 0, socket.MSG_WAITALL)
            return conn.payload_received(n) if n else conn.receive_data(b"")
        hint = 0
        if not self._tls:
            target = conn.scatter_target()
            if target is not None:
                return conn.scatter_received(self._hview, sock.recvmsg_into([self._hview, target])[0])
            hint = conn.read_hint()
        view = self._rview[:hint] if hint else self._rview
        n = sock.recv_into(view, 0, socket.MSG_WAITALL) if hint else sock.recv_into(view)
        conn.receive_data(view[:n] if n else b"")

    def close(self) -> None:
        """Shut the socket down now (a read or write under way in another thread fails with
        PeerClosedError); its number is freed once no call uses it."""
        self._users.close()


def _raise_io(exc: OSError, peer: str) -> NoReturn:
    """Raise the RemoteError family member for socket error ``exc``, naming ``peer``."""
    if isinstance(exc, socket.timeout):
        raise NetTimeoutError("socket operation timed out", peer=peer) from exc
    if isinstance(exc, ssl.SSLEOFError):  # an AuthError still: far more often a peer not speaking TLS
        why = "the peer closed the TLS connection: does it speak TLS? is it over its connection cap?"
        raise AuthError(why, peer=peer) from exc
    if isinstance(exc, ssl.SSLError):
        raise AuthError(f"TLS failure: {exc.reason or exc}", peer=peer) from exc
    raise PeerClosedError(f"connection failed: {exc}", peer=peer) from exc


class io_errors:
    """Map socket exceptions to the RemoteError family, naming the peer (a context manager)."""

    def __init__(self, peer: str) -> None:
        self.peer = peer

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        if isinstance(exc, OSError) and not isinstance(exc, NetTimeoutError):
            _raise_io(exc, self.peer)
        return False
