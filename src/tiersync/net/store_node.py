"""Store node: a host-only process lending its DRAM (a HostArena) to remote readers and writers.

Remote READ: READ_LEASE validates and pins every key (all-or-nothing; TTL clamped
to [30, 600] s), PULL serves ranges of pinned blocks, RELEASE unpins and answers
COMMITTED only when the lease was still held; expired leases are unpinned lazily.

Remote WRITE ("the destination pulls"): the writer serves its blocks on its own
listener, announces that port in its HELLO (``node_id = "tiersync-writer@PORT"``;
the node dials the writer's IP as it saw it) and OFFERs the keys under a lease on
its source. The node answers ALL_EXIST, PARTIAL_EXIST (the overlap), ACCEPT or
REFUSED (not enough FREE blocks: the node never evicts for a remote; a block
larger than the node's blocks; keys already landing). After ACCEPT/PARTIAL_EXIST
it pulls into landing blocks, releases the writer's lease and inserts
all-or-nothing: COMMITTED, or FAILED with every landing block freed.

Stored blocks stay locked in the allocator (nothing is evictable); a lease adds
one lock per block. :class:`StoreNodeClient` is the other side.
"""
from __future__ import annotations

import itertools
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator

from tiersync.errors import UsageError
from tiersync.net import events as ev
from tiersync.net.source import LEASE_TTL_MAX_S, LEASE_TTL_MIN_S, dispatch
from tiersync.net.tcp import Deadline, TcpConfig, TcpTransport, parse_address
from tiersync.net.tcp_server import TcpServer
from tiersync.tiers.host import HostArena, HostArenaConfig

log = logging.getLogger(__name__)
WRITER_PREFIX = "tiersync-writer@"
PULL_CHUNK = 16 << 20
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_conn = threading.local()  # per connection thread: the writer address announced in HELLO


def parse_size(text: str) -> int:
    """ "8GiB" / "512MiB" / "4096" -> bytes. Raises UsageError when malformed."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", str(text))
    if m is None or m.group(2).lower() not in _UNITS or int(m.group(1)) <= 0:
        raise UsageError("must be a size such as 8GiB", argument="size", value=text)
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


class StoreNode:
    """The node's request handler over a HostArena of ``capacity`` bytes. Thread-safe."""

    def __init__(self, capacity: int, block_nbytes: int = 1 << 20, *, config: TcpConfig | None = None,
                 clock: Callable[[], float] = time.monotonic, pull_timeout_s: float = 60.0) -> None:
        if capacity < block_nbytes:
            raise UsageError("capacity is smaller than one block", argument="capacity", value=capacity)
        self.arena = HostArena(HostArenaConfig(num_blocks=capacity // block_nbytes, block_nbytes=block_nbytes))
        self.config = config or TcpConfig()
        self._clock, self._pull_timeout = clock, pull_timeout_s
        self._index: dict[bytes, tuple[int, int]] = {}  # key -> (block, size)
        self._landing: set[bytes] = set()
        self._leases: dict[int, tuple[float, list[int], frozenset[bytes]]] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    # -- reads ---------------------------------------------------------------
    def __call__(self, event: object) -> list:
        with self._lock:
            self._expire()
        return dispatch(self, event)

    def _expire(self) -> None:
        now = self._clock()
        for lease_id in [i for i, (end, _, _) in self._leases.items() if end <= now]:
            self.arena.allocator.unlock(self._leases.pop(lease_id)[1])

    def _lease(self, req: ev.ReadLease) -> ev.LeaseReply:
        ttl = min(max(req.ttl_s, LEASE_TTL_MIN_S), LEASE_TTL_MAX_S)
        with self._lock:
            missing = tuple(k for k in req.keys if k not in self._index)
            if missing:
                return ev.LeaseReply(req.request_id, ev.LeaseStatus.MISSING, missing=missing)
            blocks = [self._index[k][0] for k in req.keys]
            self.arena.allocator.lock(blocks)
            lease_id = next(self._ids)
            self._leases[lease_id] = (self._clock() + ttl, blocks, frozenset(req.keys))
            sizes = tuple(self._index[k][1] for k in req.keys)
        return ev.LeaseReply(req.request_id, ev.LeaseStatus.GRANTED, lease_id, ttl, sizes)

    def _pull(self, req: ev.Pull) -> object:
        with self._lock:
            lease = self._leases.get(req.lease_id)
            if lease is None:
                return ev.Error(req.request_id, ev.ErrorCode.LEASE_EXPIRED, "lease not held")
            if req.key not in lease[2]:
                return ev.Error(req.request_id, ev.ErrorCode.NOT_FOUND, "key not under this lease")
            block, size = self._index[req.key]
        if req.offset + req.length > size:
            return ev.Error(req.request_id, ev.ErrorCode.BAD_REQUEST, "range beyond the block")
        return ev.Data(req.request_id, self.arena.block(block)[req.offset:req.offset + req.length])

    def _release(self, req: ev.Release) -> ev.CommitReply:
        with self._lock:
            lease = self._leases.pop(req.lease_id, None)
            if lease is not None:
                self.arena.allocator.unlock(lease[1])
        if lease is None:
            return ev.CommitReply(req.request_id, ev.CommitStatus.FAILED, "lease expired")
        return ev.CommitReply(req.request_id, ev.CommitStatus.COMMITTED)

    # -- writes --------------------------------------------------------------
    def offer(self, req: ev.Offer, writer: str | None = None) -> Iterator[object]:
        """Answers to OFFER ``req``: the OFFER_REPLY, then (when accepted) the COMMIT_REPLY."""
        writer = writer or getattr(_conn, "writer", None)
        reply, new, blocks = self._admit(req, writer)
        yield reply
        if not new:
            return
        try:
            self._pull_from(writer, req.lease_id, new, blocks)
        except Exception as exc:  # any failure: free the landing blocks, answer FAILED
            log.info("offer %d from %s failed: %s", req.request_id, writer, exc)
            with self._lock:
                self.arena.free(blocks)
                self._landing.difference_update(k for k, _ in new)
            yield ev.CommitReply(req.request_id, ev.CommitStatus.FAILED, str(exc)[:512])
            return
        with self._lock:
            self.arena.publish(blocks, [k for k, _ in new])
            self._index.update({k: (b, s) for (k, s), b in zip(new, blocks)})
            self._landing.difference_update(k for k, _ in new)
        yield ev.CommitReply(req.request_id, ev.CommitStatus.COMMITTED)

    def _admit(self, req: ev.Offer, writer: str | None) -> tuple[ev.OfferReply, list, list[int]]:
        refused = ev.OfferReply(req.request_id, ev.OfferStatus.REFUSED)
        with self._lock:
            existing = tuple(k for k in req.keys if k in self._index)
            new = list(dict((k, s) for k, s in zip(req.keys, req.sizes) if k not in self._index).items())
            if not new:
                return ev.OfferReply(req.request_id, ev.OfferStatus.ALL_EXIST, existing), [], []
            too_big = any(s > self.arena.block_nbytes for _, s in new)
            if writer is None or too_big or any(k in self._landing for k, _ in new) \
                    or len(new) > self.arena.allocator.num_free:
                return refused, [], []
            blocks = self.arena.allocate(len(new))  # free blocks only: checked above, under the lock
            self._landing.update(k for k, _ in new)
        status = ev.OfferStatus.PARTIAL_EXIST if existing else ev.OfferStatus.ACCEPT
        return ev.OfferReply(req.request_id, status, existing), new, blocks

    def _pull_from(self, writer: str, lease_id: int, new: list, blocks: list[int]) -> None:
        from tiersync.errors import RemoteError

        deadline = Deadline(self._pull_timeout, writer)
        channel = TcpTransport(self.config).connect(writer, timeout=deadline.remaining())
        try:
            for (key, size), b in zip(new, blocks):
                dest = self.arena.block(b)
                for off in range(0, size, PULL_CHUNK):
                    n = min(PULL_CHUNK, size - off)
                    channel.request(ev.Pull(channel.new_request_id(), lease_id, key, off, n),
                                    timeout=deadline.remaining(), into=dest[off:off + n])
            done = channel.request(ev.Release(channel.new_request_id(), lease_id), timeout=deadline.remaining())
            if done.status is not ev.CommitStatus.COMMITTED:
                raise RemoteError("writer's lease was lost before the pull finished", peer=writer)
        finally:
            channel.close()

    # -- introspection --------------------------------------------------------
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
        self.arena.close()


class StoreNodeServer(TcpServer):
    """TcpServer that records each writer's announced pull address and streams OFFER answers."""

    def __init__(self, address: str, node: StoreNode) -> None:
        self.node = node
        super().__init__(address, node, node.config)

    def _handshake(self, framed, deadline) -> None:
        read = framed.read

        def first(d):
            framed.read = read
            event = read(d)
            node_id = getattr(event, "node_id", "")
            _conn.writer = None
            if node_id.startswith(WRITER_PREFIX) and node_id[len(WRITER_PREFIX):].isdigit():
                _conn.writer = f"{parse_address(framed.peer)[0]}:{node_id[len(WRITER_PREFIX):]}"
            return event

        framed.read = first
        super()._handshake(framed, deadline)

    def _answers(self, event):
        if not isinstance(event, ev.Offer):
            return super()._answers(event)
        return _guarded(self.node.offer(event), event.request_id)


def _guarded(answers: Iterator[object], request_id: int) -> Iterator[object]:
    """An OFFER's answers; an unexpected error becomes ERROR (before the reply) or FAILED (after)."""
    sent = False
    try:
        for answer in answers:
            sent = True
            yield answer
    except Exception as exc:
        log.exception("offer handler failed")
        if sent:
            yield ev.CommitReply(request_id, ev.CommitStatus.FAILED, type(exc).__name__)
        else:
            yield ev.Error(request_id, ev.ErrorCode.INTERNAL, type(exc).__name__)


def serve(capacity: int, address: str = "127.0.0.1:0", *, token: bytes | None = None,
          block_nbytes: int = 1 << 20) -> StoreNodeServer:
    """Start a store node on ``address``; ``.address`` has the bound port, ``.node`` the handler."""
    return StoreNodeServer(address, StoreNode(capacity, block_nbytes, config=TcpConfig(token=token)))


def main(capacity: str, port: int, host: str = "127.0.0.1", token: str | None = None,
         block_size: str = "1MiB", stop: threading.Event | None = None) -> int:
    """The ``tiersync store-node`` process: print the address, serve until interrupted."""
    server = serve(parse_size(capacity), f"{host}:{port}", token=token.encode() if token else None,
                   block_nbytes=parse_size(block_size))
    print(f"tiersync store-node listening on {server.address} "
          f"({server.node.arena.num_blocks} blocks x {server.node.arena.block_nbytes} B)", flush=True)
    try:
        (stop or threading.Event()).wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
        server.node.close()
    return 0


from tiersync.net.store_client import StoreNodeClient, PushResult  # noqa: E402  (re-export)

__all__ = ["StoreNode", "StoreNodeServer", "StoreNodeClient", "PushResult", "serve", "main", "parse_size"]
