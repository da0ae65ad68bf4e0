"""Client of a store node (:mod:`tiersync.net.store_node`): push blocks to it, read them back.

Every call runs under one deadline (``timeout`` seconds, for the whole call):
past it, or when the node dies, a :class:`~tiersync.errors.RemoteError`
(NetTimeoutError, PeerClosedError, RequestError) is raised and nothing is left
pinned on this side. A refused offer raises :class:`~tiersync.errors.CapacityError`.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

from tiersync.errors import CapacityError, RemoteError, UsageError
from tiersync.net import events as ev
from tiersync.net import store_ops as so
from tiersync.net.config import coerce_token
from tiersync.net.errors import ProtocolError, ProtocolFault
from tiersync.net.service import Park, Session
from tiersync.net.source import MemoryBlockSource
from tiersync.net.tcp import Deadline, TcpChannel, TcpConfig, TcpTransport
from tiersync.net.tls import TlsConfig

PULL_WINDOW = 8
_OnPull = Callable[[so.Pull | so.PullMany | so.PullLocal], None]


def _named_host(bind: str) -> str:
    """The host an OFFER names for a listener bound to ``bind`` (and the IP this side connects
    from): a specific IP as it is, else empty (a wildcard or a host name)."""
    try:
        ip = ipaddress.ip_address(bind.strip("[]"))
    except ValueError:
        return ""
    return "" if ip.is_unspecified else bind.strip("[]")


@dataclass(frozen=True, slots=True)
class PushResult:
    """``offer``: the node's OfferStatus; ``commit``: its CommitStatus (None for ALL_EXIST)."""

    offer: so.OfferStatus
    commit: ev.CommitStatus | None
    existing: tuple[bytes, ...]


class StoreNodeClient:
    """Talks to the store node at ``address`` ("host:port").

    ``bind_host``: where this side serves its blocks for the node to pull. The node dials
    only the IP it sees us connect from: a specific IP here is also the one we connect
    from, a wildcard or a host name leaves the choice to the kernel (the node dials the IP
    it sees). Over TLS the node checks our certificate against the IP it dials. ``tls``: talk to the
    node over TLS; a writer also serves its blocks over TLS with the same files
    (``certfile``/``keyfile`` needed to push). ``on_pull`` (tests): called with each PULL (or
    PULL_MANY, PULL_LOCAL) the node sends us, before it is answered.
    """

    def __init__(
        self,
        address: str,
        *,
        token: bytes | str | None = None,
        timeout: float = 30.0,
        bind_host: str = "127.0.0.1",
        on_pull: _OnPull | None = None,
        tls: TlsConfig | None = None,
    ) -> None:
        if not timeout > 0:
            raise UsageError("must be > 0 seconds", argument="timeout", value=timeout)
        if tls is not None and not isinstance(tls, TlsConfig):
            raise UsageError("must be a TlsConfig or None", argument="tls", value=type(tls).__name__)
        self.tls = tls
        self.address, self.token, self.timeout = address, coerce_token(token), timeout
        self._bind, self._on_pull = bind_host, on_pull

    def _connect(self, deadline: Deadline, source_ip: str | None = None) -> TcpChannel:
        cfg = TcpConfig(
            token=self.token,
            tls=self.tls,
            node_id="tiersync-client",
            connect_timeout_s=min(self.timeout, 30.0),
            source_ip=source_ip,
        )
        return TcpTransport(cfg).connect(self.address, timeout=deadline.remaining())

    def offer_and_push(self, keys: Sequence[bytes], buffers: Sequence[object]) -> PushResult:
        """Offer ``keys`` (16 bytes each) with their bytes ``buffers``; the node pulls what it lacks."""
        keys = tuple(bytes(k) for k in keys)
        if len(keys) != len(buffers) or not keys:
            raise UsageError("needs one buffer per key, at least one", argument="buffers")
        deadline = Deadline(self.timeout, self.address)
        source = _ObservedSource(dict(zip(keys, buffers)), self._on_pull)
        server = TcpTransport(TcpConfig(token=self.token, tls=self.tls)).serve(f"{self._bind}:0", source)
        try:
            lease = source.lease(so.ReadLease(1, keys, ttl_s=max(int(self.timeout) + 1, 30)))
            host = _named_host(self._bind)
            pull_from = f"{host}:{server.address.rpartition(':')[2]}"
            channel = self._connect(deadline, host or None)  # the node dials back the IP it sees
            try:
                return self._offer(channel, lease, keys, pull_from, deadline)
            finally:
                channel.close()
        finally:
            server.close()

    def _offer(
        self, channel: TcpChannel, lease: so.LeaseReply, keys: tuple[bytes, ...], source: str, deadline: Deadline
    ) -> PushResult:
        rid = channel.new_request_id()
        offer = so.Offer(rid, lease.lease_id, keys, lease.sizes, source)
        reply = cast(so.OfferReply, channel.request(offer, timeout=deadline.remaining()))  # an OFFER's one answer
        if reply.status is so.OfferStatus.REFUSED:
            raise CapacityError(
                "store node refused the offer (no free space, or keys in flight)",
                requested=len(keys),
                peer=self.address,
            )
        if reply.status is so.OfferStatus.ALL_EXIST:
            return PushResult(reply.status, None, reply.existing)
        commit = cast(ev.CommitReply, channel.next_answer(rid, timeout=deadline.remaining()))
        if commit.status is not ev.CommitStatus.COMMITTED:
            raise RemoteError(f"store node failed the write: {commit.message}", peer=self.address)
        return PushResult(reply.status, commit.status, reply.existing)

    def read(self, keys: Sequence[bytes], into: Sequence[memoryview | bytearray]) -> list[int]:
        """Read ``keys`` into ``into`` (one buffer per key, at least the block's size); returns sizes.

        Raises :class:`RemoteError` (``missing`` in its context) when a key is absent.
        """
        keys = tuple(bytes(k) for k in keys)
        if len(keys) != len(into):
            raise UsageError("needs one buffer per key", argument="into")
        deadline = Deadline(self.timeout, self.address)
        channel = self._connect(deadline)
        try:
            ask = so.ReadLease(channel.new_request_id(), keys)
            lease = cast(so.LeaseReply, channel.request(ask, timeout=deadline.remaining()))
            if lease.status is not so.LeaseStatus.GRANTED:
                raise RemoteError("store node lacks keys", peer=self.address, missing=len(lease.missing))
            if len(lease.sizes) != len(keys):  # else a key without a size would be left unwritten
                raise ProtocolError(
                    "lease sizes do not match the keys",
                    fault=ProtocolFault.MALFORMED,
                    peer=self.address,
                    keys=len(keys),
                    sizes=len(lease.sizes),
                )
            try:
                self._pull_all(channel, lease, keys, into, deadline)
            except BaseException:
                if not channel.closed:  # best effort: unpin now rather than at the lease's expiry
                    channel.request(so.Release(channel.new_request_id(), lease.lease_id), timeout=1.0)
                raise
            release = so.Release(channel.new_request_id(), lease.lease_id)
            done = cast(ev.CommitReply, channel.request(release, timeout=deadline.remaining()))
            if done.status is not ev.CommitStatus.COMMITTED:
                raise RemoteError("read lease expired before the read finished", peer=self.address)
            return list(lease.sizes)
        finally:
            channel.close()

    @staticmethod
    def _pull_all(
        channel: TcpChannel,
        lease: so.LeaseReply,
        keys: tuple[bytes, ...],
        into: Sequence[memoryview | bytearray],
        deadline: Deadline,
    ) -> None:
        items: list[tuple[bytes, int, memoryview]] = []
        for key, size, buf in zip(keys, lease.sizes, into):
            view = memoryview(buf).cast("B")
            if len(view) < size:  # the node's answer, not the caller's mistake
                raise RemoteError("store node's block is larger than its buffer", need=size, got=len(view))
            items.append((key, 0, view[:size]))
        channel.pull_many(lease.lease_id, items, window=PULL_WINDOW, timeout=deadline.remaining())


class _ObservedSource(MemoryBlockSource):
    """The writer's blocks; ``on_pull`` (tests) sees every PULL / PULL_MANY before it is answered."""

    def __init__(self, blocks: Mapping[bytes, object], on_pull: _OnPull | None) -> None:
        super().__init__(blocks)
        self._on_pull = on_pull

    def handle(self, session: Session, event: object) -> Iterable[object] | Park:
        if self._on_pull is not None and isinstance(event, (so.Pull, so.PullMany, so.PullLocal)):
            self._on_pull(event)
        return super().handle(session, event)
