"""Optional TLS for transports, via the standard :mod:`ssl` module."""

from __future__ import annotations

import ssl
from dataclasses import dataclass

from tiersync.errors import UsageError


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """Certificates (PEM paths) for one side.

    ``certfile``/``keyfile``: this side's chain (required on a server; on a
    client only for mutual auth). ``cafile``: the CA that signs the *peer*.
    ``require_peer_cert``: a server refuses clients without a cert signed by
    ``cafile`` (mutual TLS); a client always verifies the server.
    ``server_hostname``: the name (or IP) checked against the server cert; None
    means the host part of the address.
    """

    cafile: str
    certfile: str | None = None
    keyfile: str | None = None
    require_peer_cert: bool = False
    server_hostname: str | None = None

    def __post_init__(self) -> None:
        if not self.cafile:
            raise UsageError("a CA file is required", argument="cafile")
        if (self.certfile is None) != (self.keyfile is None):
            raise UsageError("certfile and keyfile go together", argument="keyfile")


def server_context(cfg: TlsConfig) -> ssl.SSLContext:
    """A server context; raises UsageError when no cert is configured."""
    if cfg.certfile is None:
        raise UsageError("a TLS server needs certfile and keyfile", argument="certfile")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.options |= ssl.OP_NO_RENEGOTIATION  # a write never waits for a read: held answers are retried as they are
    ctx.load_cert_chain(cfg.certfile, cfg.keyfile)
    ctx.load_verify_locations(cfg.cafile)
    ctx.verify_mode = ssl.CERT_REQUIRED if cfg.require_peer_cert else ssl.CERT_OPTIONAL
    return ctx


def client_context(cfg: TlsConfig) -> ssl.SSLContext:
    """A client context that verifies the server against ``cafile``."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.options |= ssl.OP_NO_RENEGOTIATION  # a write never waits for a read: held answers are retried as they are
    ctx.load_verify_locations(cfg.cafile)
    if cfg.certfile is not None:
        ctx.load_cert_chain(cfg.certfile, cfg.keyfile)
    return ctx
