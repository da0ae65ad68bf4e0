"""The settings of ``tiersync router`` (:mod:`tiersync.integrations.router`), validated."""

from __future__ import annotations

import ssl
from dataclasses import dataclass

from tiersync.errors import UsageError, check_positive_int

__all__ = ["RouterConfig"]


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """``prefill`` / ``decode``: base URLs of vLLM OpenAI servers (``http://host:port``);
    ``timeout_s``: bound of one upstream request; ``client_timeout_s``: a client's whole
    request (and the wait for the next one on a kept-alive connection) must arrive within it;
    ``max_body``: largest request accepted; ``max_bodies``: request bytes held at once, all
    clients together (a parsed JSON body takes some 20x its size). ``upstream_ca``: a PEM file
    of the CA certificates that verify ``https://`` upstreams (None: the system's)."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    timeout_s: float = 600.0
    max_body: int = 64 << 20
    max_connections: int = 256
    client_timeout_s: float = 30.0
    max_bodies: int = 256 << 20
    upstream_ca: str | None = None

    def __post_init__(self) -> None:
        for name in ("prefill", "decode"):
            urls = getattr(self, name)
            if (
                isinstance(urls, str)
                or not urls
                or not all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in urls)
            ):
                raise UsageError("must be one or more http://host:port URLs", argument=name, value=urls)
            object.__setattr__(self, name, tuple(u.rstrip("/") for u in urls))
        for name in ("timeout_s", "client_timeout_s"):
            t = getattr(self, name)
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < 1e6:
                raise UsageError("must be a number of seconds in (0, 1e6)", argument=name, value=t)
        for name in ("max_body", "max_connections", "max_bodies"):
            check_positive_int(getattr(self, name), name)
        if self.max_body > self.max_bodies:  # such a body would be refused (503) for good
            raise UsageError("must be at most max_bodies", argument="max_body", max_bodies=self.max_bodies)
        if self.upstream_ca is not None:
            self.upstream_context()  # a file that is not there, or holds no certificate, is refused now

    def upstream_context(self) -> ssl.SSLContext | None:
        """The TLS context of ``https://`` upstreams (None: urllib's default, the system's CAs).
        Raises UsageError naming ``upstream_ca`` when its file cannot be read as CA certificates."""
        if self.upstream_ca is None:
            return None
        if not isinstance(self.upstream_ca, str) or not self.upstream_ca:
            raise UsageError("must be the path of a PEM file", argument="upstream_ca", value=self.upstream_ca)
        try:
            return ssl.create_default_context(cafile=self.upstream_ca)
        except (OSError, ssl.SSLError) as exc:
            raise UsageError(f"cannot load CA certificates: {exc}", argument="upstream_ca") from None
