"""Store node: a host-only process lending its DRAM (a HostArena) to remote readers and writers.

Remote READ: READ_LEASE pins every key (all-or-nothing; TTL clamped to [30, 600] s), PULL serves ranges of
pinned blocks, RELEASE unpins and answers COMMITTED only when the lease was still held; expired leases are
unpinned lazily. Remote WRITE ("the destination pulls"): the writer OFFERs keys under a lease on its own
listener (``source``: its port; the node dials only the IP the writer's connection comes from, with a
descriptor it keeps in reserve for that; an OFFER naming another host is ERROR(BAD_REQUEST)). It answers
ALL_EXIST, PARTIAL_EXIST (the overlap), ACCEPT or REFUSED (too few FREE blocks: it never evicts for a remote;
a block too large; keys landing), pulls into landing blocks, releases the lease and inserts all-or-nothing:
COMMITTED, or FAILED with every landing block freed (freed too when the reply cannot be written). Stored
blocks stay locked; a lease adds one lock per block. ``main(registry=)`` advertises the keys
(:mod:`~tiersync.net.registry.agent`), ``main(kv_events=)`` as vLLM KV events; listeners get new keys before
COMMITTED. :class:`StoreNodeClient` is the other side.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from tiersync.errors import CapacityError, UsageError, check_positive_int
from tiersync.net import events as ev
from tiersync.net import store_ops as so
from tiersync.net.background import Background
from tiersync.net.deadlines import Deadlines
from tiersync.net.errors import NetTimeoutError
from tiersync.net.frames import SUPPORTED, PayloadChecksum, payload_checksum
from tiersync.net.offer_source import WriterPulls, writer_address
from tiersync.net.server import TcpServer
from tiersync.net.service import Park, Session
from tiersync.net.source import MAX_LEASED_KEYS, BlockError, BlockService, clamp_ttl, new_lease_id
from tiersync.net.tcp import TcpConfig
from tiersync.tiers.host import HostArena, HostArenaConfig

if TYPE_CHECKING:
    from tiersync.net.tls import TlsConfig

log = logging.getLogger(__name__)
PULL_CHUNK = 16 << 20
_LAND_S = 10.0  # past its pull's deadline, what checksumming and inserting a pull's blocks may take
MIN_BLOCK_NBYTES = 1 << 10  # a smaller block costs more in bookkeeping than it holds (KV blocks are >= 16 KiB)


def _arena(num_blocks: int, block_nbytes: int) -> HostArena:
    """The node's DRAM: shareable (same-host readers map it and copy at memory speed) where this
    host makes memfds, else private memory (readers use ``process_vm_readv`` or TCP)."""
    try:
        return HostArena(HostArenaConfig(num_blocks=num_blocks, block_nbytes=block_nbytes, shareable=True))
    except CapacityError as exc:
        log.warning("store node memory is not shareable (%s): same-host readers copy it through the kernel", exc)
        return HostArena(HostArenaConfig(num_blocks=num_blocks, block_nbytes=block_nbytes))


class StoreNode(BlockService):
    """The node's block service over a HostArena of ``capacity`` bytes. Thread-safe."""

    def __init__(
        self,
        capacity: int,
        block_nbytes: int = 1 << 20,
        *,
        config: TcpConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        pull_timeout_s: float = 60.0,
        pullers: int = 8,
        on_stored: Callable[[list[bytes]], None] | None = None,
    ) -> None:
        check_positive_int(pullers, "pullers")
        if isinstance(block_nbytes, bool) or not isinstance(block_nbytes, int) or block_nbytes < MIN_BLOCK_NBYTES:
            raise UsageError(f"must be at least {MIN_BLOCK_NBYTES} bytes", argument="block_size", value=block_nbytes)
        if capacity < block_nbytes:
            raise UsageError("capacity is smaller than one block", argument="capacity", value=capacity)
        self.arena = _arena(capacity // block_nbytes, block_nbytes)
        super().__init__(shared=[self.arena.shared] if self.arena.shared is not None else [])
        self.config = config or TcpConfig()
        self._clock, self._pull_timeout = clock, pull_timeout_s
        self._listeners: list[Callable[[list[bytes]], None]] = [on_stored] if on_stored is not None else []
        self._index: dict[bytes, tuple[int, int, int]] = {}  # key -> (block, size, checksum of the bytes)
        self._landing: set[bytes] = set()
        self._leases: Deadlines[int, tuple[list[int], frozenset[bytes]]] = Deadlines()  # id -> (blocks, keys)
        self._leased_keys = 0
        self._lock = threading.Lock()
        self._writers = WriterPulls(self.config)
        self._pulls = Background(pullers, "tiersync-store-pull")

    @property
    def private_memory(self) -> bool:
        """False when the arena is shareable: every block is then read out of a map of it."""
        return not self.shared

    # -- reads ---------------------------------------------------------------
    def handle(self, session: Session, event: object) -> Iterable[object] | Park:
        with self._lock:
            self._expire()
        return super().handle(session, event)

    def _expire(self) -> None:
        """Unpin the leases past their end (the soonest first: no scan of those still held)."""
        for _, (blocks, _) in self._leases.due(self._clock()):
            self._unpin(blocks)

    def _unpin(self, blocks: list[int]) -> None:
        self._leased_keys -= len(blocks)  # one per key asked, repeats included: what lease() added
        self.arena.allocator.unlock(blocks)

    def lease(self, req: so.ReadLease) -> so.LeaseReply:
        """Pin every key (all or nothing); BlockError(CAPACITY) past MAX_LEASED_KEYS under lease."""
        ttl = clamp_ttl(req.ttl_s)
        with self._lock:
            missing = tuple(k for k in req.keys if k not in self._index)
            if missing:
                return so.LeaseReply(req.request_id, so.LeaseStatus.MISSING, missing=missing)
            if self._leased_keys + len(req.keys) > MAX_LEASED_KEYS:
                raise BlockError(ev.ErrorCode.CAPACITY, f"{self._leased_keys} keys are under lease here")
            blocks = [self._index[k][0] for k in req.keys]
            self.arena.allocator.lock(blocks)
            lease_id, end = new_lease_id(self._leases), self._clock() + ttl
            self._leases.set(lease_id, end, (blocks, frozenset(req.keys)))
            self._leased_keys += len(req.keys)
            sizes = tuple(self._index[k][1] for k in req.keys)
        return so.LeaseReply(req.request_id, so.LeaseStatus.GRANTED, lease_id, ttl, sizes)

    def view(
        self, lease_id: int, key: bytes, offset: int, length: int
    ) -> tuple[memoryview, tuple[PayloadChecksum, int] | None]:
        """A stored block's bytes; a whole block comes with the checksum kept since it was
        stored (a read never sums it again: blocks do not change while stored)."""
        return self.views(lease_id, [(key, offset, length)])[0]

    def views(
        self, lease_id: int, items: Iterable[tuple[bytes, int, int]]
    ) -> list[tuple[memoryview, tuple[PayloadChecksum, int] | None]]:
        found = self._found(lease_id, items)
        return [(self.arena.block(b)[o : o + n], None if c is None else (SUPPORTED[0], c)) for b, o, n, c in found]

    def regions(self, lease_id: int, items: Iterable[tuple[bytes, int, int]]) -> np.ndarray:
        """Addresses from block ids (the arena is one mapping), no view per item; only a part of
        a block is summed here."""
        found = self._found(lease_id, items)
        self.arena.check_open()
        rows = np.array([(b, o, n, c or 0) for b, o, n, c in found], np.uint64).reshape(-1, 4)
        out = np.empty((len(rows), 3), np.uint64)
        stride = np.uint64(self.arena.config.block_nbytes)  # the memory is (num_blocks, block_nbytes)
        out[:, 0] = np.uint64(self.arena.address) + rows[:, 0] * stride + rows[:, 1]
        out[:, 1:] = rows[:, 2:]
        for i, (b, o, n, c) in enumerate(found):
            if c is None:
                out[i, 2] = payload_checksum(SUPPORTED[0], self.arena.block(b)[o : o + n])
        return out

    def _found(self, lease_id: int, items: Iterable[tuple[bytes, int, int]]) -> list[tuple[int, int, int, int | None]]:
        """(block, offset, length, checksum of a whole block else None) of each item, all or
        BlockError; the lease checked once for all of them, each item as view checks it."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                raise BlockError(ev.ErrorCode.LEASE_EXPIRED, "lease not held")
            found = []
            for key, offset, length in items:
                if key not in lease[1]:
                    raise BlockError(ev.ErrorCode.NOT_FOUND, "key not under this lease")
                block, size, checksum = self._index[key]
                if offset + length > size:
                    raise BlockError(ev.ErrorCode.BAD_REQUEST, "range beyond the block")
                found.append((block, offset, length, checksum if offset == 0 and length == size else None))
        return found

    def holds(self, lease_id: int) -> bool:
        with self._lock:
            self._expire()
            return lease_id in self._leases

    def release(self, lease_id: int) -> bool:
        with self._lock:
            lease = self._leases.pop(lease_id)
            if lease is not None:
                self._unpin(lease[0])
        return lease is not None

    # -- writes --------------------------------------------------------------
    def offer(self, req: so.Offer, session: Session | None = None) -> Iterable[object] | Park:
        """Answers to OFFER ``req``: the OFFER_REPLY, then (when accepted) the COMMIT_REPLY once
        the pull ended. An unexpected error becomes ERROR (before the reply) or FAILED (after).
        The pull runs on the node's own ``pullers`` threads while the writer's session is parked
        (:mod:`~tiersync.net.background`): slow writers hold none of the server's workers.

        ``session``: the writer's; the node dials only its IP (:func:`writer_address`), and an
        OFFER naming another host is answered ERROR(BAD_REQUEST) saying why.
        """
        if session is not None:  # asked again once its pull ended (or its park's deadline passed)
            done = self._pulls.take(session, req.request_id, time.monotonic() + self._pull_timeout)
            if done is not None:
                return done
        return _guarded(self._offer(req, session), req.request_id)

    def _offer(self, req: so.Offer, session: Session | None) -> Generator[object, None, None]:
        try:
            writer = writer_address(req.source, session.peer if session is not None else None)
        except BlockError as exc:
            log.info("offer %d from %s refused: %s", req.request_id, session and session.peer, exc)
            yield ev.Error(req.request_id, exc.code, str(exc))
            return
        reply, new, blocks = self._admit(req, writer)
        try:
            yield reply
        except BaseException:  # GeneratorExit: the reply could not be written
            if new:
                self._unland(new, blocks)
            raise
        if not new:
            return
        deadline = time.monotonic() + self._pull_timeout  # from now, the wait for a puller included
        land = partial(self._land, req, writer, new, blocks, deadline)  # owns the blocks from here
        if session is None:
            yield from land()
            return
        try:
            park = self._pulls.start(session, req.request_id, land, deadline + _LAND_S)
        except BaseException:  # no puller could take it (the node closes, no thread): nothing lands
            self._unland(new, blocks)
            raise
        if session.closed:  # ended before its pull was recorded: closed() found nothing to drop
            self._pulls.drop(session)
        yield park

    def _land(
        self, req: so.Offer, writer: str, new: list[tuple[bytes, int]], blocks: list[int], deadline: float
    ) -> list[object]:
        """Pull the blocks, then insert them all, or free them all: the COMMIT_REPLY (never raises)."""
        try:
            self._pull_from(writer, req.lease_id, new, blocks, deadline)
            sums = [self._sum_stored(key, self.arena.block(b)[:size]) for (key, size), b in zip(new, blocks)]
            with self._lock:
                self.arena.publish(blocks, [k for k, _ in new])
                self._index.update({k: (b, s, c) for (k, s), b, c in zip(new, blocks, sums)})
                self._landing.difference_update(k for k, _ in new)
        except Exception as exc:  # noqa: BLE001 - any failure: free the landing blocks, answer FAILED
            log.info("offer %d from %s failed: %s", req.request_id, writer, exc)
            try:
                self._unland(new, blocks)
            except Exception:
                log.exception("freeing the landing blocks of offer %d failed", req.request_id)
            return [ev.CommitReply(req.request_id, ev.CommitStatus.FAILED, str(exc)[:512])]
        for listener in self._listeners:
            try:
                listener([k for k, _ in new])
            except Exception:  # stored all the same: a listener's failure is its own
                log.exception("a listener of stored keys failed")
        return [ev.CommitReply(req.request_id, ev.CommitStatus.COMMITTED)]

    def closed(self, session: Session) -> None:
        self._pulls.drop(session)  # a pull under way lands all the same
        super().closed(session)

    def _unland(self, new: list[tuple[bytes, int]], blocks: list[int]) -> None:
        with self._lock:  # an OFFER's landing blocks and keys freed (the keys first: even if freeing fails)
            self._landing.difference_update(k for k, _ in new)
            self.arena.free(blocks)

    def _sum_stored(self, key: bytes, view: memoryview) -> int:
        """A landed block's checksum; with TSUM64 its partial state is kept from the same pass,
        so PULL_MANYs of stored blocks compose their checksum without reading them again."""
        if SUPPORTED[0] is PayloadChecksum.TSUM64:
            return self._partials.remember(key, view)
        return payload_checksum(SUPPORTED[0], view)

    def _admit(self, req: so.Offer, writer: str) -> tuple[so.OfferReply, list[tuple[bytes, int]], list[int]]:
        refused = so.OfferReply(req.request_id, so.OfferStatus.REFUSED)
        with self._lock:
            existing = tuple(k for k in req.keys if k in self._index)
            new = list({k: s for k, s in zip(req.keys, req.sizes) if k not in self._index}.items())
            if not new:
                return so.OfferReply(req.request_id, so.OfferStatus.ALL_EXIST, existing), [], []
            too_big = any(s > self.arena.block_nbytes for _, s in new)
            if too_big or any(k in self._landing for k, _ in new) or len(new) > self.arena.allocator.num_free:
                return refused, [], []
            blocks = self.arena.allocate(len(new))  # free blocks only: checked above, under the lock
            self._landing.update(k for k, _ in new)
        status = so.OfferStatus.PARTIAL_EXIST if existing else so.OfferStatus.ACCEPT
        return so.OfferReply(req.request_id, status, existing), new, blocks

    def _pull_from(
        self, writer: str, lease_id: int, new: list[tuple[bytes, int]], blocks: list[int], deadline: float
    ) -> None:
        items = [
            (key, off, self.arena.block(b)[off : off + min(PULL_CHUNK, size - off)])
            for (key, size), b in zip(new, blocks)
            for off in range(0, size, PULL_CHUNK)
        ]
        left = deadline - time.monotonic()
        if left <= 0:
            raise NetTimeoutError("the pull waited for a free puller past pull_timeout_s", peer=writer)
        self._writers.pull(writer, lease_id, items, left)

    def add_listener(self, fn: Callable[[list[bytes]], None]) -> None:
        """Call ``fn(keys)`` with the keys of every committed write, before COMMITTED is sent
        (keep it short: it runs on the thread that pulled them)."""
        self._listeners.append(fn)

    # -- introspection --------------------------------------------------------
    def held_keys(self) -> list[bytes]:
        """Every key stored (landing ones excluded)."""
        with self._lock:
            return list(self._index)

    @property
    def stored(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def active_leases(self) -> int:
        with self._lock:
            return len(self._leases)

    @property
    def free_blocks(self) -> int:
        return self.arena.allocator.num_free

    def close(self) -> None:
        """Free the node; pulls under way end first (at once: they fail, and free their blocks)."""
        self._writers.close()
        self._pulls.close()  # none may land in the arena once it is gone
        self.arena.close()


class StoreNodeServer(TcpServer):
    """The TcpServer of a :class:`StoreNode` (``.node``)."""

    def __init__(self, address: str, node: StoreNode) -> None:
        self.node = node
        super().__init__(address, node, node.config)


def _guarded(answers: Generator[object, None, None], request_id: int) -> Iterator[object]:
    """An OFFER's answers; an unexpected error becomes ERROR (before the reply) or FAILED (after)."""
    sent = False
    try:
        for answer in answers:
            sent = True
            yield answer
    except GeneratorExit:  # our answer could not be written: the offer's own cleanup runs now
        answers.close()
        raise
    except Exception as exc:
        log.exception("offer handler failed")
        if sent:
            yield ev.CommitReply(request_id, ev.CommitStatus.FAILED, type(exc).__name__)
        else:
            yield ev.Error(request_id, ev.ErrorCode.INTERNAL, type(exc).__name__)


def serve(
    capacity: int,
    address: str = "127.0.0.1:0",
    *,
    token: bytes | str | None = None,
    block_nbytes: int = 1 << 20,
    tls: TlsConfig | None = None,
) -> StoreNodeServer:
    """Start a store node on ``address``; ``.address`` has the bound port, ``.node`` the handler.
    ``tls``: its listener serves only TLS, and it dials writers over TLS with the same files."""
    return StoreNodeServer(address, StoreNode(capacity, block_nbytes, config=TcpConfig(token=token, tls=tls)))


from tiersync.net.store_attach import attach_events, attach_registry, default_advertise  # noqa: E402
from tiersync.net.store_client import PushResult, StoreNodeClient  # noqa: E402  (re-export)

__all__ = [
    "PushResult",
    "StoreNode",
    "StoreNodeClient",
    "StoreNodeServer",
    "attach_events",
    "attach_registry",
    "default_advertise",
    "serve",
    "writer_address",
]
