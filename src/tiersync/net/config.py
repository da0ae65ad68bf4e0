"""The settings of one endpoint of the wire stack (:class:`TcpConfig`), and the one address
and token checks every link uses.

Every service — store nodes, prefill -> decode, weight sync — connects and serves through
:class:`TcpConfig`: the same token (shared-secret HMAC), TLS, deadlines, connection cap,
worker pool and same-host route. Nothing here reads the environment; the CLI and the
integrations do (:func:`token_from`).
"""

from __future__ import annotations

import enum
import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tiersync.errors import UsageError, check_positive_int
from tiersync.net.frames import ProtocolConfig
from tiersync.net.tls import TlsConfig

__all__ = ["MIN_TOKEN_BYTES", "ByReference", "Route", "TcpConfig", "coerce_token", "parse_address", "token_from"]

MIN_TOKEN_BYTES = 16


class Route(enum.Enum):
    """How bytes move once a connection is up. ``AUTO``: same-host reads
    (``process_vm_readv``, :mod:`tiersync.net.local`) when the handshake shows both ends on
    one host and the read is permitted, TCP otherwise. ``LOCAL``: same-host reads or an
    error. ``TCP``: always the socket."""

    AUTO = "auto"
    LOCAL = "local"
    TCP = "tcp"


class ByReference(enum.Enum):
    """How a server sends DATA whose bytes stay put until the peer read them
    (:attr:`~tiersync.net.events.Data.pinned`) on plain TCP. ``ALWAYS``: by reference
    (vmsplice + splice: the kernel holds the sender's pages, no copy on this side).
    ``NEVER``: copied into the socket. ``AUTO``: by reference unless the peer's address is
    one of this host's: those bytes cross this kernel's loopback, and the reader copying
    them out of the sender's cold pages, a 4 KiB fragment at a time, cost the host more than
    the sender's one copy into socket buffers the reader then finds in cache (4 samplers of
    a 248 MB version on a 2-core EPYC VM: 0.36-0.37 sampler CPU-s against 0.20 copied, the
    version 1.2x slower). Across a network only the sender's side is this host's."""

    AUTO = "auto"
    ALWAYS = "always"
    NEVER = "never"


def parse_address(address: Any, argument: str = "address") -> tuple[str, int]:
    """Split "host:port" (an IPv6 host may be bracketed; port 0 allowed: pick one). Raises
    UsageError naming ``argument``."""
    host, sep, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 <= int(port) < 65536:
        raise UsageError("must be 'host:port' with a port in [0, 65535]", argument=argument, value=address)
    return host.strip("[]"), int(port)


def coerce_token(value: Any, argument: str = "token") -> bytes | None:
    """A shared secret as bytes: ``str`` (UTF-8) or ``bytes`` of at least 16 bytes, or None
    (no token). Raises UsageError naming ``argument`` (the value is never echoed)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = value.encode("utf-8")
    if not isinstance(value, (bytes, bytearray)) or len(value) < MIN_TOKEN_BYTES:
        raise UsageError(f"must be a str or bytes of at least {MIN_TOKEN_BYTES} bytes (or None)", argument=argument)
    return bytes(value)


def token_from(
    token_file: str | None, environ: Mapping[str, str] | None = None, *, argument: str = "--token-file"
) -> bytes | None:
    """The token of a process: the contents of ``token_file`` (trailing newline stripped),
    else ``$TIERSYNC_TOKEN``, else None. Command lines never carry the secret itself (argv is
    readable by every local user). Raises UsageError naming ``argument`` or the variable."""
    if token_file is not None:
        try:
            with open(token_file, "rb") as f:
                raw = f.read(1 << 16).rstrip(b"\r\n")
        except OSError as exc:
            raise UsageError(
                f"cannot read the token file: {exc.strerror}", argument=argument, path=token_file
            ) from None
        return coerce_token(raw, argument)
    env = os.environ if environ is None else environ
    value = env.get("TIERSYNC_TOKEN")
    return coerce_token(value, "TIERSYNC_TOKEN") if value else None


@dataclass(frozen=True, slots=True)
class TcpConfig:
    """Settings of one endpoint (client and server side alike).

    ``token``: shared secret (str or bytes, >= 16 bytes); when set, peers must prove it
    (HMAC) and so must we. ``tls``: optional :class:`TlsConfig` (mutual with
    ``require_peer_cert``). Timeouts are seconds (> 0): ``connect_timeout_s`` bounds a
    connect plus handshake (a server closes a connection that has not finished its
    handshake by then), ``op_timeout_s`` one request. ``max_connections``: a server's cap on
    open connections (at it, a new one ends the oldest still in its handshake, else it is
    answered ERROR(CAPACITY) and closed); ``workers``: the
    server's pool running requests. ``route``: see :class:`Route`; ``local_threads``: threads
    copying one same-host read (default: up to 4 of the cores this process may use);
    ``local_maps``: same-host reads copy out of a map of the server's memory where it offers
    shareable memory (a sealed memfd), else with ``process_vm_readv`` (False: always the
    latter). ``source_ip``: a client connects from this local IP (None: the kernel picks).
    ``by_reference``: see :class:`ByReference`. ``keepalive_s``: a connection whose peer stopped
    answering at all (its host lost power, a partition) is closed after about this long without
    traffic, by TCP keepalive probes (0: none); without them an idle session of a dead peer held
    its slot and buffers for good. Raises UsageError naming the field.
    """

    sndbuf: int = 16 << 20
    rcvbuf: int = 16 << 20
    nodelay: bool = True
    connect_timeout_s: float = 5.0
    op_timeout_s: float = 120.0
    token: bytes | str | None = None
    tls: TlsConfig | None = None
    node_id: str = "tiersync"
    recv_chunk: int = 256 << 10
    backlog: int = 1024
    max_connections: int = 4096
    workers: int = 32
    route: Route = Route.AUTO
    local_threads: int = field(default_factory=lambda: min(4, len(os.sched_getaffinity(0))))
    local_maps: bool = True
    protocol: ProtocolConfig = field(default_factory=ProtocolConfig)
    source_ip: str | None = None
    keepalive_s: float = 120.0
    by_reference: ByReference = ByReference.AUTO

    def __post_init__(self) -> None:
        for name in ("sndbuf", "rcvbuf", "recv_chunk", "backlog", "max_connections", "workers", "local_threads"):
            check_positive_int(getattr(self, name), name)
        for name in ("connect_timeout_s", "op_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise UsageError("must be > 0 seconds", argument=name, value=value)
        if isinstance(self.keepalive_s, bool) or not isinstance(self.keepalive_s, (int, float)):
            raise UsageError("must be seconds (0: no keepalive)", argument="keepalive_s", value=self.keepalive_s)
        if not 0 <= self.keepalive_s <= 65534:  # the kernel's idle time is at most 32767 s
            raise UsageError("must be in [0, 65534] seconds", argument="keepalive_s", value=self.keepalive_s)
        object.__setattr__(self, "token", coerce_token(self.token))
        if self.tls is not None and not isinstance(self.tls, TlsConfig):
            raise UsageError("must be a TlsConfig or None", argument="tls")
        if not isinstance(self.local_maps, bool):
            raise UsageError("must be a bool", argument="local_maps", value=self.local_maps)
        if not isinstance(self.route, Route):
            raise UsageError("must be a Route", argument="route", value=self.route)
        if not isinstance(self.by_reference, ByReference):
            raise UsageError("must be a ByReference", argument="by_reference", value=self.by_reference)
        if not isinstance(self.protocol, ProtocolConfig):
            raise UsageError("must be a ProtocolConfig", argument="protocol")
        if self.source_ip is not None:
            try:
                ipaddress.ip_address(self.source_ip)
            except (TypeError, ValueError):
                raise UsageError("must be an IP address or None", argument="source_ip", value=self.source_ip) from None
