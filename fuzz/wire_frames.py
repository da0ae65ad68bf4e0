"""atheris target: arbitrary bytes fed to a wire-protocol :class:`Connection` as its peer's stream.

Run: ``python fuzz/wire_frames.py -max_total_time=3600`` (see fuzz/README.md). The core is
:func:`one_input`, which tests/test_fuzz_targets.py also runs without atheris; the
hypothesis twin is tests/net/test_protocol_fuzz.py.

Input: byte 0 picks the role (bit 0) and whether the connection is fresh or already past
the handshake (bit 1, so the fuzzer reaches the request and answer parsers at once); byte
1 the chunk size the stream is fed in; the rest is the stream, then EOF. Invariants: only
:class:`ProtocolError` escapes ``receive_data`` / ``next_event``, after which the connection
is poisoned (:class:`ClosedError`); every ``next_event`` returns and a drain stops; no
buffered payload outgrows the configured max frame size.
"""

from __future__ import annotations

try:
    import atheris
except ImportError:  # the tests run one_input without it
    atheris = None

import _mutate  # fuzz/_mutate.py: the script's directory is on sys.path
from tiersync.errors import ClosedError
from tiersync.net import events as ev
from tiersync.net.errors import ProtocolError
from tiersync.net.frames import SUPPORTED, ProtocolConfig
from tiersync.net.protocol import NEED_DATA, Connection, Role

SMALL = ProtocolConfig(max_frame_size=8192, max_meta_size=2048, max_keys=64)
DRAIN_LIMIT = 10_000


def drain(conn: Connection) -> list:
    """Events until NEED_DATA or ConnectionClosed; a drain that does not stop is a hang."""
    out = []
    for _ in range(DRAIN_LIMIT):
        event = conn.next_event()
        if event is NEED_DATA or isinstance(event, ev.ConnectionClosed):
            return out
        out.append(event)
        assert len(getattr(event, "payload", b"") or b"") <= SMALL.max_frame_size, "oversize payload"
    raise AssertionError("next_event did not stop")


def deliver(src: Connection, dst: Connection, event) -> None:
    dst.receive_data(b"".join(bytes(b) for b in src.send(event)))
    drain(dst)


def ready_pair() -> tuple[Connection, Connection]:
    """A client and a server past the handshake."""
    client, server = Connection(Role.CLIENT, SMALL), Connection(Role.SERVER, SMALL)
    deliver(client, server, ev.Hello("fuzz", b"c" * 16))
    deliver(server, client, ev.Challenge(b"s" * 16, b"p" * 32, SUPPORTED[0]))
    deliver(client, server, ev.Auth(b"q" * 32))
    deliver(server, client, ev.Ready(1))
    return client, server


def connection(mode: int) -> Connection:
    if mode & 2:
        client, server = ready_pair()
        return server if mode & 1 else client
    return Connection(Role.SERVER if mode & 1 else Role.CLIENT, SMALL)


def one_input(data: bytes) -> None:
    if len(data) < 2:
        return
    conn, chunk, wire = connection(data[0]), data[1] + 1, data[2:]
    try:
        for at in range(0, len(wire), chunk):
            conn.receive_data(wire[at : at + chunk])
            drain(conn)
        conn.receive_data(b"")
        drain(conn)
    except ProtocolError as exc:
        for call in (conn.next_event, lambda: conn.receive_data(b"x")):
            try:
                call()
            except ClosedError:
                continue
            raise AssertionError("a connection that raised ProtocolError is not poisoned") from exc


def main() -> None:
    _mutate.fuzz(one_input, atheris)


if __name__ == "__main__":
    main()
