"""A sampler's control links to the trainer shards: the channels and what they announced.

:class:`ShardLink` is the link to one trainer shard; :class:`TrainerLinks` holds one per
shard, reads their control channels (ANNOUNCE, READY) and waits on what they announced: every
shard's manifest of a version, tensor ``i`` of it written. It sends the sampler's one-way
answers (ACK, RELEASE) and maps the shared-memory segments it reads.

A link that ends (the trainer shard died or restarted) is registered again, retrying with
backoff until the receiver closes. Each trainer process has its own incarnation (in its
W_WELCOME and manifests; the sampler's GETs name it, see :mod:`~tiersync.weights.ops`), and a
restarted shard reuses version numbers with other bytes. So a version is queued as
:class:`~tiersync.weights.version_queue.Announced`: with each shard's incarnation and
registration at that moment. What a link announced is forgotten when it registers again; a
version that a shard lacks fails at once when that shard was up when the version was announced
and has since died or registered again (what its next registration announces is queued anew),
and is waited for when that shard was down then (it may come back and announce it). ACKs and
RELEASEs go only to the incarnations whose manifests they are about.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from tiersync.errors import RemoteError, TierSyncError, UsageError
from tiersync.net.errors import AuthError, ProtocolError, ProtocolFault, RequestError, log_level
from tiersync.net.socket_io import Deadline
from tiersync.net.tcp import TcpChannel, TcpTransport
from tiersync.weights.config import TransportKind
from tiersync.weights.manifest import Manifest
from tiersync.weights.ops import Ack, Announce, Ready, Register, Release, Welcome
from tiersync.weights.segment import SegmentReader
from tiersync.weights.version_queue import Announced

__all__ = ["ShardLink", "TrainerLinks"]

log = logging.getLogger(__name__)

_BACKOFF_S = (0.1, 5.0)  # first and longest wait between attempts to register again


class ShardLink:
    """The control channel to one trainer shard and what its current incarnation announced."""

    def __init__(self, rank: int, address: str) -> None:
        self.rank, self.address = rank, address
        self.channel: TcpChannel | None = None
        self.transport = TransportKind.TCP
        self.incarnation = 0  # 0 until registered
        self.registration = 0  # registrations so far
        self.manifests: dict[int, Manifest] = {}
        self.ready: dict[int, int] = {}
        self.alive = False
        self.readers: dict[str, SegmentReader] = {}  # segment path -> mapping (latest last)

    def adopt(self, channel: TcpChannel, welcome: Welcome) -> bool:
        """Registered (again) over ``channel``: what the last registration announced is forgotten
        (a version in flight then is not announced again); True when as a new incarnation."""
        restarted = welcome.incarnation != self.incarnation and self.incarnation != 0
        self.incarnation, self.registration = welcome.incarnation, self.registration + 1
        self.manifests.clear()
        self.ready.clear()
        self.channel, self.transport, self.alive = channel, welcome.transport, True
        return restarted

    def state(self) -> tuple[int, int] | None:
        """``(incarnation, registration)`` while the link is up, else None."""
        return (self.incarnation, self.registration) if self.alive else None


def _send(rank: int, channel: TcpChannel, event: object, timeout: float) -> None:
    """Send one-way message ``event`` to trainer shard ``rank`` (thread-safe); a failure is
    logged: the control reader notices the lost link."""
    try:
        channel.send(event, timeout=timeout)
    except TierSyncError as exc:
        log.log(log_level(exc), "%s to trainer shard %s failed: %s", type(event).__name__, rank, exc)


def register(shard: ShardLink, transport: TcpTransport, hello: Register, timeout: float) -> tuple[TcpChannel, Welcome]:
    """Connect to ``shard``, send ``hello`` (its request id is replaced) and take the W_WELCOME:
    the transport granted, the incarnation. AuthError (token/TLS refused), UsageError
    (transport refused), RemoteError (unreachable) or ProtocolError."""
    try:
        channel = transport.connect(shard.address)
    except AuthError as exc:
        raise AuthError(
            f"trainer shard {shard.rank} refused the link ({exc.message}); ReceiverConfig.token "
            "and tls must match its PublisherConfig",
            peer=shard.address,
        ) from None
    hello = Register(
        channel.new_request_id(), hello.label, hello.rank, hello.host, hello.transport, hello.relay, hello.zero_copy
    )
    try:
        welcome = channel.request(hello, timeout=timeout)
        if not isinstance(welcome, Welcome) or welcome.source_rank != shard.rank:
            raise ProtocolError(
                "expected W_WELCOME from this source rank", fault=ProtocolFault.UNEXPECTED, peer=shard.address
            )
    except RequestError as exc:
        channel.close()
        raise UsageError(f"trainer shard {shard.rank} refused: {exc.message}", argument="transport") from None
    except BaseException:
        channel.close()
        raise
    return channel, welcome


class TrainerLinks:
    """One :class:`ShardLink` per address of ``publishers`` (index = source rank).
    ``announced(Announced)`` is called for every manifest a shard announces; sends time out
    after ``io_timeout_s``."""

    def __init__(self, publishers: list[str], io_timeout_s: float, announced: Callable[[Announced], None]) -> None:
        self._shards = [ShardLink(r, a) for r, a in enumerate(publishers)]
        self._io_timeout, self._announced = io_timeout_s, announced
        self._cond = threading.Condition()
        self._closed = False
        self._epoch = 0  # shards that came back as another incarnation

    def transports(self) -> tuple[TransportKind, ...]:
        """Per trainer shard, the transport it granted (SHM or TCP)."""
        return tuple(s.transport for s in self._shards)

    def transport_map(self) -> dict[int, TransportKind]:
        return {s.rank: s.transport for s in self._shards}

    def addresses(self) -> dict[int, str]:
        return {s.rank: s.address for s in self._shards}

    def connect(self, transport: TcpTransport, hello: Register) -> None:
        """Register with every trainer shard (see :func:`register`), then follow its control channel."""
        for shard in self._shards:
            channel, welcome = register(shard, transport, hello, self._io_timeout)
            with self._cond:
                shard.adopt(channel, welcome)
            name = f"ctl-{shard.rank}"
            threading.Thread(target=self._follow, args=(shard, transport, hello), daemon=True, name=name).start()

    def _follow(self, shard: ShardLink, transport: TcpTransport, hello: Register) -> None:
        """Read the shard's control channel; once it ends, register again (backing off) and go
        on reading, until the links stop."""
        wait = _BACKOFF_S[0]
        while True:
            channel = shard.channel
            assert channel is not None  # adopt set it before this thread started or looped
            self._read_control(shard, channel)
            while True:
                with self._cond:
                    if self._cond.wait_for(lambda: self._closed, wait):
                        return
                try:
                    got = register(shard, transport, hello, self._io_timeout)
                except TierSyncError as exc:
                    log.log(log_level(exc), "trainer shard %s: registering again failed: %s", shard.rank, exc)
                    wait = min(_BACKOFF_S[1], wait * 2)
                    continue
                except Exception:  # what no path foresaw (a socket option refused): tried again all the same
                    log.exception("trainer shard %s: registering again failed", shard.rank)
                    wait = min(_BACKOFF_S[1], wait * 2)
                    continue
                with self._cond:
                    if self._closed:
                        got[0].close()
                        return
                    self._epoch += shard.adopt(*got)
                    self._cond.notify_all()
                log.info("trainer shard %s registered again (incarnation %x)", shard.rank, shard.incarnation)
                wait = _BACKOFF_S[0]
                break

    def _read_control(self, shard: ShardLink, channel: TcpChannel) -> None:
        try:
            while True:
                event = channel.receive()
                if isinstance(event, Announce):
                    self._announce(shard, event.manifest)
                elif isinstance(event, Ready):
                    self._ready(shard, event)
                else:
                    raise ProtocolError(
                        f"unexpected {type(event).__name__}", fault=ProtocolFault.UNEXPECTED, peer=shard.address
                    )
        except TierSyncError as exc:
            log.log(log_level(exc), "trainer shard %s control ended: %s", shard.rank, exc)
            channel.close()
        except Exception:  # a bug, or what no parser foresaw: the link is dead all the same
            log.exception("trainer shard %s control ended by an unexpected error", shard.rank)
            channel.close()
        with self._cond:
            shard.alive = False
            self._cond.notify_all()

    def _ready(self, shard: ShardLink, event: Ready) -> None:
        """Tensors ``[0, count)`` of an announced version are in the shard's segment; a READY
        for a version this registration did not announce, or counting past its tensors, is
        malformed (one kept per announced version, so a hostile trainer cannot grow the map)."""
        with self._cond:
            m = shard.manifests.get(event.version)
            if m is None or event.count > len(m.names):
                raise ProtocolError(
                    "READY for a version not announced, or past its tensors",
                    fault=ProtocolFault.MALFORMED,
                    peer=shard.address,
                )
            shard.ready[event.version] = max(event.count, shard.ready.get(event.version, 0))
            self._cond.notify_all()

    def _announce(self, shard: ShardLink, m: Manifest) -> None:
        if m.source_rank != shard.rank or m.incarnation != shard.incarnation:
            raise ProtocolError(
                "manifest of another source rank or incarnation", fault=ProtocolFault.MALFORMED, peer=shard.address
            )
        with self._cond:
            shard.manifests[m.version] = m
            for old in [v for v in shard.manifests if v < m.version - 4]:
                shard.manifests.pop(old, None)
                shard.ready.pop(old, None)
            self._cond.notify_all()
            got = Announced(m.version, self._epoch, tuple(s.state() for s in self._shards))
        # outside the links' lock: the version queue's lock is held while futures' callbacks run,
        # and a callback may close the receiver (which takes this lock): no lock-order inversion.
        # One reader thread per shard calls this, so each shard's versions queue in order.
        self._announced(got)

    def manifests(self, got: Announced, deadline: Deadline) -> list[Manifest]:
        """Every shard's manifest of version ``got.version`` (by source rank), once all announced
        it; the segments of the shared-memory ones mapped. A shard down when it was announced is
        waited for (until ``deadline``): it may come back and announce it."""
        version = got.version
        with self._cond:
            while not all(_has(s, then, version) for s, then in zip(self._shards, got.shards)):
                self._check_coming(got)
                self._cond.wait(deadline.remaining())
            manifests = [s.manifests[version] for s in self._shards]
        if any(not m.same_model(manifests[0]) or m.source_ranks != len(self._shards) for m in manifests):
            raise UsageError("trainer shards disagree on the model (or their number)", argument="publishers")
        with self._cond:  # close() unmaps the readers under it: none is added once it has
            if self._closed:
                raise RemoteError("receiver closed", version=version)
            for s, m in zip(self._shards, manifests):
                segment = _segment(s, m) if s.transport is TransportKind.SHM else None
                if segment is not None and segment not in s.readers:
                    s.readers[segment] = SegmentReader(segment, m.payload_bytes)
                    for old in list(s.readers)[:-4]:  # a zero-copy lease keeps its mapping alive
                        s.readers.pop(old).close()
        return manifests

    def _check_coming(self, got: Announced) -> None:
        """RemoteError unless every shard that lacks version ``got.version`` may still announce
        it (under the lock)."""
        version = got.version
        if self._closed:
            raise RemoteError("receiver closed", version=version)
        for s, then in zip(self._shards, got.shards):
            if _has(s, then, version):
                continue
            if then is not None and s.state() != then:  # up then; died or registered again since
                raise RemoteError("a trainer shard went away (or restarted) before announcing", version=version)
            if s.alive and max(s.manifests, default=-1) > version:
                # shards announce in order: a later version without this one means its
                # manifest was dropped (more than 4 behind) and will never come
                raise RemoteError("superseded: a trainer shard announced later versions only", version=version)

    def readers(self, manifests: list[Manifest]) -> dict[int, SegmentReader]:
        """Source rank -> the mapped segment of its manifest, for the shared-memory shards."""
        return {
            s.rank: s.readers[_segment(s, m)]
            for s, m in zip(self._shards, manifests)
            if s.transport is TransportKind.SHM
        }

    def reader(self, rank: int, segment: str) -> SegmentReader:
        return self._shards[rank].readers[segment]

    def wait_ready(self, rank: int, incarnation: int, version: int, index: int, deadline: Deadline) -> None:
        """Block until shard ``rank`` wrote tensor ``index`` of ``version``, as announced on its
        current registration by ``incarnation`` (a READY of another is about another segment)."""
        shard = self._shards[rank]
        with self._cond:
            while True:
                if self._closed or (shard.incarnation, version in shard.manifests) != (incarnation, True):
                    raise RemoteError("trainer shard restarted mid-version", peer=shard.address, version=version)
                if shard.ready.get(version, 0) > index:
                    return
                if not shard.alive:
                    raise RemoteError("trainer shard went away mid-version", peer=shard.address, version=version)
                self._cond.wait(deadline.remaining())

    def release(self, incarnations: tuple[int, ...], version: int) -> None:
        """Tell every shared-memory shard still of ``incarnations[rank]`` this sampler no longer
        reads ``version``."""
        with self._cond:
            to = [(s.rank, c) for s, c in self._of(incarnations) if s.transport is TransportKind.SHM]
        for rank, channel in to:
            _send(rank, channel, Release(version), self._io_timeout)

    def answer(self, incarnations: tuple[int, ...], ack: Ack) -> None:
        """Send ``ack`` to every shard still of ``incarnations[rank]`` that announced its version."""
        with self._cond:
            to = [(s.rank, c) for s, c in self._of(incarnations) if ack.version in s.manifests]
        for rank, channel in to:
            _send(rank, channel, ack, self._io_timeout)

    def _of(self, incarnations: tuple[int, ...]) -> list[tuple[ShardLink, TcpChannel]]:
        """The live shards whose incarnation is ``incarnations[rank]``, with their channels (under the lock)."""
        return [
            (s, s.channel)
            for s, i in zip(self._shards, incarnations)
            if s.alive and s.channel is not None and s.incarnation == i != 0
        ]

    def stop(self) -> None:
        """Wake every wait: they fail from now on."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def close(self) -> None:
        """Close the control channels (their readers end) and unmap the segments (after
        :meth:`stop`: no sync maps another one meanwhile)."""
        self.stop()
        with self._cond:
            readers = [r for s in self._shards for r in s.readers.values()]
            channels = [s.channel for s in self._shards if s.channel is not None]
        for channel in channels:
            channel.close()  # wakes the control reader blocked in receive
        for r in readers:
            r.close()


def _has(shard: ShardLink, then: tuple[int, int] | None, version: int) -> bool:
    """Whether ``shard`` announced ``version`` on the registration it had then (``then``), or,
    when it was down then, on one it has registered since and is still up on."""
    if version not in shard.manifests:
        return False
    return shard.alive if then is None else (shard.incarnation, shard.registration) == then


def _segment(shard: ShardLink, m: Manifest) -> str:
    """The segment a shared-memory shard's manifest names; ProtocolError when it names none."""
    if m.segment is None:
        raise ProtocolError(
            "a shared-memory trainer shard announced no segment", fault=ProtocolFault.MALFORMED, peer=shard.address
        )
    return m.segment
