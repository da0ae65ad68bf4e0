"""Configuration and status values of trainer -> sampler weight sync.

One frozen, validated dataclass per component: :class:`PublisherConfig` (the trainer
shard side) and :class:`ReceiverConfig` (the sampler side). Both raise
:class:`~tiersync.errors.UsageError` naming the offending field; nothing is read from the
environment here (the CLI does that). Both carry the link's ``token`` and ``tls`` into the
:class:`~tiersync.net.config.TcpConfig` of every connection they open or serve.
"""

from __future__ import annotations

import enum
import os
import secrets
import socket
from dataclasses import dataclass, field

from tiersync.errors import UsageError, check_positive_int
from tiersync.net.config import Route, TcpConfig, coerce_token, parse_address
from tiersync.net.frames import ProtocolConfig
from tiersync.net.tls import TlsConfig

__all__ = [
    "MAX_LABEL",
    "MAX_SPAN_BYTES",
    "PublisherConfig",
    "ReceiveResult",
    "ReceiverConfig",
    "SyncStatus",
    "TransportKind",
    "process_label",
]

MAX_SPAN_BYTES = 64 << 20
"""Largest span one GET moves: the planner cuts chunks to ``segment_bytes``, at most this."""


class TransportKind(enum.Enum):
    """How a sampler gets the bytes of one trainer shard.

    ``AUTO``: shared memory when the sampler runs on the trainer's host (same machine id and
    boot id) and the trainer offers a segment, TCP otherwise. ``SHM``: shared memory or a
    registration error. ``TCP``: always TCP, even on the same host.
    """

    AUTO = "auto"
    SHM = "shm"
    TCP = "tcp"


class SyncStatus(enum.Enum):
    """Outcome of one version for one sampler."""

    OK = "ok"  #: every shard arrived, checked, and the sampler switched to the version
    FAILED = "failed"  #: the sampler reported an error (its message says which)
    DISCONNECTED = "disconnected"  #: the sampler's connection dropped before it answered
    TIMEOUT = "timeout"  #: no answer before the publish deadline


@dataclass(frozen=True, slots=True)
class ReceiveResult:
    """Version ``version`` is active: ``nbytes`` landed in ``seconds`` (announce to switch), of
    which ``moved`` were fetched (shm, tcp, relay) and ``copied`` copied from the other buffer
    set (a delta sync; the rest was already in place)."""

    version: int
    nbytes: int
    seconds: float
    transports: tuple[TransportKind, ...]  # per trainer shard
    moved: int = 0
    copied: int = 0


def _check_seconds(value: object, argument: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise UsageError("must be a number of seconds > 0", argument=argument, value=value)


def _check_link(token: object, tls: object) -> bytes | None:
    """The token as bytes (str or bytes of >= 16 bytes, or None); UsageError naming ``token``
    or ``tls``."""
    if tls is not None and not isinstance(tls, TlsConfig):
        raise UsageError("must be a TlsConfig or None", argument="tls")
    return coerce_token(token, "token")


def _tcp_config(cfg: PublisherConfig | ReceiverConfig, connect_timeout_s: float, node_id: str) -> TcpConfig:
    """A weight-sync endpoint's TcpConfig. A server's answer to a GET may wait up to
    ``io_timeout_s`` for its bytes before it is written, so one operation gets twice that."""
    protocol = ProtocolConfig(max_frame_size=MAX_SPAN_BYTES + cfg.max_meta_bytes, max_meta_size=cfg.max_meta_bytes)
    return TcpConfig(
        connect_timeout_s=connect_timeout_s,
        op_timeout_s=2 * cfg.io_timeout_s,
        token=cfg.token,
        tls=cfg.tls,
        node_id=node_id,
        route=Route.TCP,
        protocol=protocol,
    )


def _check_address(value: object, argument: str) -> None:
    parse_address(value, argument)


@dataclass(frozen=True, slots=True)
class PublisherConfig:
    """Settings of one trainer shard's :class:`~tiersync.weights.publisher.WeightPublisher`.

    ``listen``: control + data address ("host:port", port 0 picks one).
    ``shm``: write each version into a ``/dev/shm`` segment (one write, many readers); when
    False every sampler uses TCP. ``shm_dir``: where the segment lives.
    ``publish_timeout_s``: how long :meth:`publish` waits for the samplers' answers.
    ``io_timeout_s``: deadline of one socket operation. ``fanout``: receivers one sender
    serves per chunk before receivers relay (the planner's k). ``segment_bytes``: chunks
    are cut into pieces of at most this size (pipelining, TCP request size; <= 64 MiB).
    ``max_meta_bytes``: bound on one control message's metadata.
    ``token``: shared secret (str or bytes, >= 16 bytes) every sampler must prove (HMAC) on
    every connection, control and data; None accepts only samplers without one.
    ``tls``: optional :class:`~tiersync.net.tls.TlsConfig` (a certificate and key; with
    ``require_peer_cert`` samplers need one signed by ``cafile``). Every TCP payload is
    checksummed by the wire stack.
    """

    listen: str = "127.0.0.1:0"
    shm: bool = True
    shm_dir: str = "/dev/shm"
    publish_timeout_s: float = 120.0
    io_timeout_s: float = 30.0
    fanout: int = 64
    segment_bytes: int = 16 << 20
    max_meta_bytes: int = 4 << 20
    token: bytes | str | None = field(default=None, repr=False)  # never printed
    tls: TlsConfig | None = None

    def __post_init__(self) -> None:
        _check_address(self.listen, "listen")
        object.__setattr__(self, "token", _check_link(self.token, self.tls))
        if not isinstance(self.shm, bool):
            raise UsageError("must be a bool", argument="shm")
        if not isinstance(self.shm_dir, str) or not self.shm_dir:
            raise UsageError("must be a directory path", argument="shm_dir", value=self.shm_dir)
        _check_seconds(self.publish_timeout_s, "publish_timeout_s")
        _check_seconds(self.io_timeout_s, "io_timeout_s")
        for name in ("fanout", "segment_bytes", "max_meta_bytes"):
            check_positive_int(getattr(self, name), name)
        if self.segment_bytes > MAX_SPAN_BYTES:
            raise UsageError(f"must be at most {MAX_SPAN_BYTES} (one GET)", argument="segment_bytes")

    def tcp_config(self, node_id: str) -> TcpConfig:
        """The TcpConfig of this trainer shard's server (handshakes bounded by ``io_timeout_s``)."""
        return _tcp_config(self, self.io_timeout_s, node_id)


@dataclass(frozen=True, slots=True)
class ReceiverConfig:
    """Settings of one sampler's :class:`~tiersync.weights.receiver.WeightReceiver`.

    ``publishers``: the control address of every trainer shard, in source-rank order
    (``publishers[r]`` serves source rank ``r``). ``rank``: this sampler's rank in its
    destination mesh. ``transport``: see :class:`TransportKind`. ``buffers``: 2 =
    double-buffered (a version switch is atomic and readers of the old version keep it
    until they release it); 1 = single-buffered (half the memory; a sync writes the live
    weights, so readers must not run during a sync). ``streams``: TCP connections per
    sender. ``window``: GETs in flight on each of them (chunks with one source; a relayed
    chunk, which may fall back to the trainer, is fetched alone, and a trainer shard that
    relayed chunks fall back to keeps one of its streams for them); a strided chunk of many
    rows is staged, so up to ``window`` of them per stream are held at once. A stream's
    pipelined GETs end with the sync's deadline, each step of them within ``io_timeout_s``.
    ``copy_threads``: threads copying slices out of shared memory.
    ``listen``: where this sampler serves relays to other samplers.
    ``sync_timeout_s``: deadline of one version's sync (announce to switch);
    ``lease_timeout_s``: how long a sync waits for readers to release the standby buffer;
    ``io_timeout_s``: one socket operation; ``connect_timeout_s``: one connect.
    ``sampler_id``: this sampler's label among a publisher's samplers, at most 255 printable
    characters (a registration under the label and rank of one it has replaces the old one:
    a sampler that came back; default ``"sampler-<rank>@<host>:<pid>-<random>"``, new for each
    receiver).
    ``zero_copy``: serve a tensor straight out of the trainer's shared-memory segment
    (read-only views in the lease, no copy) when this sampler's slice of it is one contiguous
    run of one SHM shard's bytes; other tensors are copied. The trainer then writes later
    versions to other segments until this sampler released the version (no lease, not active).
    ``delta``: fetch only the chunks whose trainer checksum differs from what this sampler
    holds (:mod:`tiersync.weights.delta`); False fetches every byte of every version.
    ``token``: the trainer's shared secret (str or bytes, >= 16 bytes), proven on every
    connection (control, data, relays); relaying samplers demand it too. ``tls``: optional
    :class:`~tiersync.net.tls.TlsConfig`: ``cafile`` verifies the trainer shards and relays;
    a certificate and key (also the client certificate of mutual TLS) let this sampler serve
    relays over TLS; without one it serves none (its relays come from the trainer instead).
    """

    publishers: tuple[str, ...]
    rank: int = 0
    transport: TransportKind = TransportKind.AUTO
    buffers: int = 2
    streams: int = 4
    window: int = 4
    copy_threads: int = 2
    listen: str = "127.0.0.1:0"
    sync_timeout_s: float = 120.0
    lease_timeout_s: float = 60.0
    io_timeout_s: float = 30.0
    connect_timeout_s: float = 10.0
    sampler_id: str | None = None
    max_meta_bytes: int = 4 << 20
    zero_copy: bool = False
    delta: bool = True
    token: bytes | str | None = field(default=None, repr=False)  # never printed
    tls: TlsConfig | None = None

    def __post_init__(self) -> None:
        pubs = self.publishers
        if isinstance(pubs, str) or not isinstance(pubs, (tuple, list)) or not pubs:
            raise UsageError("must be a non-empty sequence of 'host:port'", argument="publishers", value=pubs)
        for p in pubs:
            _check_address(p, "publishers")
        object.__setattr__(self, "publishers", tuple(pubs))
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise UsageError("must be an int >= 0", argument="rank", value=self.rank)
        if not isinstance(self.transport, TransportKind):
            raise UsageError("must be a TransportKind", argument="transport", value=self.transport)
        if self.buffers not in (1, 2) or isinstance(self.buffers, bool):
            raise UsageError("must be 1 or 2", argument="buffers", value=self.buffers)
        for name in ("zero_copy", "delta"):
            if not isinstance(getattr(self, name), bool):
                raise UsageError("must be a bool", argument=name, value=getattr(self, name))
        for name in ("streams", "window", "copy_threads", "max_meta_bytes"):
            check_positive_int(getattr(self, name), name)
        _check_address(self.listen, "listen")
        for name in ("sync_timeout_s", "lease_timeout_s", "io_timeout_s", "connect_timeout_s"):
            _check_seconds(getattr(self, name), name)
        if self.sampler_id is not None and not _is_label(self.sampler_id):
            raise UsageError(
                f"must be None or 1 to {MAX_LABEL} printable characters", argument="sampler_id", value=self.sampler_id
            )
        object.__setattr__(self, "token", _check_link(self.token, self.tls))

    def tcp_config(self) -> TcpConfig:
        """The TcpConfig of this sampler's connections and of its relay server."""
        return _tcp_config(self, self.connect_timeout_s, f"weights-{self.label}")

    @property
    def relays(self) -> bool:
        """Whether this sampler serves relays (always, except over TLS without a certificate)."""
        return self.tls is None or self.tls.certfile is not None

    @property
    def label(self) -> str:
        """``sampler_id`` or ``"sampler-<rank>"``: the name of this sampler's connections (the
        label it registers under is :attr:`WeightReceiver.label
        <tiersync.weights.receiver.WeightReceiver.label>`)."""
        return self.sampler_id or f"sampler-{self.rank}"


MAX_LABEL = 255


def _is_label(text: object) -> bool:
    return isinstance(text, str) and 0 < len(text) <= MAX_LABEL and text.isprintable()


def process_label(prefix: str, rank: int) -> str:
    """``"<prefix>-<rank>@<host>:<pid>-<random>"``: a label no other sampler has, in another
    engine, container (the same host name and pid) or receiver of this process (the workers of
    several engines share ranks). At most :data:`MAX_LABEL` characters."""
    host = "".join(c for c in socket.gethostname() if c.isprintable())[:64]
    return f"{prefix[:128]}-{rank}@{host}:{os.getpid()}-{secrets.token_hex(4)}"
