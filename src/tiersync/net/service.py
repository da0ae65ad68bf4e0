"""What a server runs: a :class:`Service` answering the requests of :class:`Session` s.

The server (:class:`~tiersync.net.server.TcpServer`) owns sockets, the handshake, the
connection cap and the worker pool; a service owns only its operations:

- :meth:`Service.handle` is called on a pool worker with each request (or one-way message)
  of a session, in arrival order per session, and yields the answers. A request it cannot
  answer yet it answers :class:`Park` rather than blocking a worker of the bounded pool
  (``TcpConfig.workers``) for as long as it waits: see :mod:`tiersync.net.parking`. An
  exception ``handle`` raises becomes an ERROR answer (UsageError-like ``ValueError`` ->
  BAD_REQUEST, else INTERNAL) and the session stays open; one a generator it returned raises
  while yielding ends the session (some of its answers may have gone out).
- :meth:`Service.opened` / :meth:`Service.closed` bracket a session's life: ``closed`` runs
  exactly once for every opened session, however it ended (peer closed, protocol error,
  deadline, server close), so a service releases the leases and pins a session held there.
- :meth:`Session.send` pushes a one-way message from any thread (the weights publisher's
  ANNOUNCE); it is thread-safe against the worker answering on the same session.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tiersync.errors import UsageError
from tiersync.net.vocab import Vocabulary

__all__ = ["Park", "PeerInfo", "Service", "Session", "Watch"]

Watch = Callable[[Callable[[], object]], None]
"""``watch(wake)`` arranges for ``wake()`` to be called (from any thread; at once if what it
waits for is already there) when what it waits for may be there; later calls are ignored."""


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """What the handshake told about the other end: its ``node_id``, its host identity and pid
    (:func:`tiersync.net.local.host_identity`), whether it runs on this host (``same_host``:
    same identity, so its memory can be read with ``process_vm_readv``), and the largest frame
    both ends accept (``max_frame``: the lesser ``max_frame_size``, this end's where the peer
    stated none; 0 only in a PeerInfo made by hand)."""

    node_id: str
    host: str
    pid: int
    same_host: bool
    max_frame: int = 0


@dataclass(frozen=True, slots=True)
class Park:
    """:meth:`Service.handle`'s answer to a request it cannot answer yet: the server keeps the
    session, without a worker, and asks the handler again with the same request once ``watch``'s
    callback runs, ``deadline`` (``time.monotonic()``) passes, or the session ends.
    ``watch(wake)`` must arrange for ``wake()`` to be called (from any thread; at once if the
    answer may already be there) when the answer may be ready; later calls are ignored.

    ``late``: the request's answers once it waited too long. With them, the deadline is the
    one of the request's first park, however often it parks again, and a request asked again
    past it that parks once more is answered ``late`` instead (the handler keeps no state to
    know how long a request waited); such a Park must be its request's first answer (asked
    again from the start, a handler would repeat what it answered before it). Without them,
    each park has its own deadline, and the handler answers when it has waited enough."""

    watch: Watch
    deadline: float
    late: tuple[object, ...] | None = None

    def __post_init__(self) -> None:
        if self.late is not None and (not self.late or any(isinstance(a, Park) for a in self.late)):
            raise UsageError("must be None or one answer at least, none of them a Park", argument="late")


class Session(ABC):
    """One authenticated connection as a service sees it."""

    peer: str
    """The remote "ip:port"."""
    session_id: int
    info: PeerInfo

    @abstractmethod
    def send(self, event: object, *, timeout: float | None = None) -> None:
        """Send a one-way message now (thread-safe). Raises ClosedError once the session ended,
        RemoteError when the peer is gone or the deadline passed (the session is then closed).
        Behind answers the peer has not taken yet it is queued, up to a cap (1 MiB), past which
        it waits for them to be written."""

    @abstractmethod
    def close(self) -> None:
        """End the session (idempotent); :meth:`Service.closed` runs."""

    @property
    @abstractmethod
    def closed(self) -> bool:
        """True once the session ended."""


class Service(ABC):
    """The operations of one server (see the module docstring)."""

    vocabulary: Vocabulary

    @abstractmethod
    def handle(self, session: Session, event: object) -> Iterable[object] | Park:
        """The answers to request ``event`` in order (none for a one-way message), or
        :class:`Park` (not yet)."""

    def opened(self, session: Session) -> None:  # noqa: B027 - a default hook, overridden when needed
        """A session finished its handshake."""

    def closed(self, session: Session) -> None:  # noqa: B027 - a default hook, overridden when needed
        """A session ended (exactly once per opened session)."""
