"""A trainer shard's registered samplers: their control sessions, registrations and answers.

:class:`SamplerRegistry` answers the control messages a :class:`~tiersync.weights.serving.SpanService`
hands on (W_REGISTER -> W_WELCOME, then each sampler's one-way W_ACK and W_RELEASE), drops a
sampler whose session ended (or that registered again under its label) and collects the
answers of one version into :class:`~tiersync.weights.publish_result.SamplerOutcome` s.
It works under the publisher's condition and calls the publisher's
:class:`~tiersync.weights.segment.SegmentPool` (None without shared memory) under it: a
RELEASE frees a zero-copy sampler's hold on a segment, a drop retires its segments.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from tiersync.errors import TierSyncError
from tiersync.net import events as ev
from tiersync.net.config import parse_address
from tiersync.net.errors import NetTimeoutError
from tiersync.net.local import local_address
from tiersync.net.service import Session
from tiersync.weights.config import SyncStatus, TransportKind
from tiersync.weights.ops import Ack, Register, Release, Welcome
from tiersync.weights.publish_result import SamplerOutcome
from tiersync.weights.segment import SegmentPool

__all__ = ["Sampler", "SamplerRegistry"]

log = logging.getLogger(__name__)
_KEPT_ACKS = 16  # a sampler's answers kept, newest versions (collect asks for one in flight)


@dataclass(eq=False)
class Sampler:
    """One registered sampler (compared by identity: it is a segment holder key)."""

    label: str
    rank: int
    session: Session  # its control connection
    transport: TransportKind
    relay: str
    zc: bool = False  # serves from the segment (zero-copy): holds each version until RELEASE
    alive: bool = True
    acks: dict[int, Ack] = field(default_factory=dict)


class SamplerRegistry:
    """The samplers of source rank ``rank`` (on host ``host``), guarded by ``cond``; sends time
    out after ``io_timeout_s``."""

    def __init__(
        self,
        cond: threading.Condition,
        pool: SegmentPool | None,
        host: str,
        rank: int,
        io_timeout_s: float,
        incarnation: int = 0,
    ) -> None:
        self._cond, self._pool, self._host, self._rank = cond, pool, host, rank
        self._incarnation = incarnation
        self._io_timeout = io_timeout_s
        self._samplers: dict[tuple[str, int], Sampler] = {}  # by (label, rank): engines share ranks
        self._by_session: dict[int, Sampler] = {}
        self._closed = False

    def labels(self) -> dict[str, int]:
        """Registered, connected samplers: label -> destination rank (a label several ranks
        share is listed once)."""
        with self._cond:
            return {s.label: s.rank for s in self._samplers.values() if s.alive}

    def live(self) -> list[Sampler]:
        """The registered, connected samplers now (a version's targets)."""
        with self._cond:
            return [s for s in self._samplers.values() if s.alive]

    def wait_for(self, count: int, timeout: float, peer: str) -> None:
        """Block until ``count`` samplers are registered; NetTimeoutError after ``timeout`` seconds."""
        end = time.monotonic() + timeout
        with self._cond:
            while sum(s.alive for s in self._samplers.values()) < count:
                left = end - time.monotonic()
                if left <= 0 or self._closed:
                    raise NetTimeoutError(f"{len(self._samplers)} of {count} samplers registered", peer=peer)
                self._cond.wait(left)

    def send(self, s: Sampler, event: object) -> None:
        """Send one-way ``event`` to ``s``; a failure drops it (the publisher checks an ANNOUNCE
        against its own limits first: one too large for a sampler's stated limit is its own)."""
        try:
            s.session.send(event, timeout=self._io_timeout)
        except (TierSyncError, OSError) as exc:
            log.info("sampler %s dropped: %s", s.label, exc)
            self.drop(s)

    def collect(self, version: int, targets: list[Sampler], timeout: float) -> tuple[SamplerOutcome, ...]:
        """Every target's outcome for ``version``, once each answered or went away (at most
        ``timeout`` s; at once when the registry stops: the publisher is closing)."""
        end = time.monotonic() + timeout
        with self._cond:
            while not self._closed and any(s.alive and version not in s.acks for s in targets):
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return tuple(_outcome(s, version) for s in sorted(targets, key=lambda s: s.rank))

    def control(self, session: Session, event: object) -> Iterable[object]:
        """W_REGISTER -> W_WELCOME; then the sampler's one-way W_ACK and W_RELEASE."""
        if isinstance(event, Register):
            return self._register(session, event)
        with self._cond:
            s = self._by_session.get(session.session_id)
            known = s is not None and isinstance(event, (Ack, Release))
            if s is not None and isinstance(event, Ack):
                s.acks[event.version] = event
                while len(s.acks) > _KEPT_ACKS:  # a sampler's answers to old versions are not asked for
                    del s.acks[min(s.acks)]
            elif s is not None and isinstance(event, Release) and self._pool is not None:
                self._pool.release(s, event.version)
            self._cond.notify_all()
        if not known:
            log.info("closing %s: %s out of place", session.peer, type(event).__name__)
            session.close()
        return ()

    def _register(self, session: Session, hello: Register) -> Iterator[ev.Error | Welcome]:
        """A generator: W_WELCOME is written before the sampler takes part (so no ANNOUNCE
        overtakes it); a registration under the label and rank of one registered already (a
        sampler that came back) drops the old one, with a warning if its connection was still
        open. Samplers of one rank under other labels (the workers of several engines) each
        take part."""
        with self._cond:
            again = session.session_id in self._by_session
        if again:  # one sampler per connection
            yield ev.Error(hello.request_id, ev.ErrorCode.BAD_REQUEST, "this connection registered already")
            return
        shm_ok = self._pool is not None and hello.host == self._host and _from_this_host(session)
        if hello.transport is TransportKind.SHM and not shm_ok:
            yield ev.Error(
                hello.request_id,
                ev.ErrorCode.UNSUPPORTED,
                "shared memory is not available to this sampler (other host or no segment)",
            )
            return
        got = TransportKind.SHM if shm_ok and hello.transport is not TransportKind.TCP else TransportKind.TCP
        yield Welcome(hello.request_id, got, self._rank, self._incarnation)
        zc = got is TransportKind.SHM and hello.zero_copy
        s = Sampler(hello.label, hello.rank, session, got, hello.relay, zc=zc)
        with self._cond:
            old = self._samplers.get((s.label, s.rank))
            self._samplers[(s.label, s.rank)] = s
            self._by_session[session.session_id] = s
            self._cond.notify_all()
        if old is not None:
            if not old.session.closed:
                log.warning(
                    "sampler %s (rank %d) from %s replaces the one from %s",
                    s.label,
                    s.rank,
                    session.peer,
                    old.session.peer,
                )
            self.drop(old)
        if session.closed or self._closed:  # ended while it was being welcomed
            self.drop(s)

    def ended(self, session: Session) -> None:
        """``session`` ended: drop its sampler."""
        with self._cond:
            s = self._by_session.get(session.session_id)
        if s is not None:
            log.info("sampler %s disconnected", s.label)
            self.drop(s)

    def drop(self, s: Sampler) -> None:
        """Once per sampler: forget it, retire the segments it held, end its session."""
        with self._cond:
            if not s.alive:
                return
            s.alive = False
            if self._samplers.get((s.label, s.rank)) is s:
                del self._samplers[(s.label, s.rank)]
            self._by_session.pop(s.session.session_id, None)
            if self._pool is not None and s.zc:
                self._pool.orphan(s)  # it may still serve from them: never rewrite those
            self._cond.notify_all()
        s.session.close()

    def stop(self) -> list[Sampler]:
        """Refuse registrations from now on (they are dropped once welcomed) and wake the
        waiters; the samplers registered now, for the caller to :meth:`drop`."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            return list(self._samplers.values())


def _outcome(s: Sampler, version: int) -> SamplerOutcome:
    ack = s.acks.get(version)
    if ack is None:
        status = SyncStatus.TIMEOUT if s.alive else SyncStatus.DISCONNECTED
        return SamplerOutcome(s.label, s.rank, status, s.transport, f"no answer ({status.value})")
    if ack.ok:
        return SamplerOutcome(s.label, s.rank, SyncStatus.OK, s.transport, None, ack.seconds, ack.moved)
    return SamplerOutcome(s.label, s.rank, SyncStatus.FAILED, s.transport, ack.error, ack.seconds, ack.moved)


def _from_this_host(session: Session) -> bool:
    """The sampler's connection comes from an address of this host. Its host id alone is a
    string a remote sampler could repeat (every manifest carries it) to be granted shared
    memory, and zero-copy holds that fill /dev/shm."""
    try:
        return local_address(parse_address(session.peer)[0])
    except TierSyncError:
        return False
