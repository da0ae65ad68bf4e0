"""The ``tiersync registry`` process: the gRPC control plane over a memory or Redis backend.

State lives in the backend: with ``--redis`` it survives a restart of this
process; with the memory backend it does not, and store nodes re-register (and
re-publish what they hold) at their next heartbeat.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from tiersync.errors import TierSyncError, UsageError
from tiersync.net.registry.base import Registry, RegistryConfig
from tiersync.net.registry.redis_backend import shown_url

if TYPE_CHECKING:
    from tiersync.net.tls import TlsConfig

log = logging.getLogger(__name__)
HEALTH_INTERVAL_S = 10.0


def make_backend(redis_url: str | None, config: RegistryConfig) -> Registry:
    """A RedisRegistry on ``redis_url``, or a MemoryRegistry when it is None."""
    if redis_url:
        from tiersync.net.registry.redis_backend import RedisRegistry

        return RedisRegistry(redis_url, config)
    from tiersync.net.registry.memory import MemoryRegistry

    return MemoryRegistry(config)


def main(
    port: int,
    host: str = "127.0.0.1",
    redis_url: str | None = None,
    *,
    store_ttl_s: float = 900.0,
    block_ttl_s: float = 3600.0,
    heartbeat_interval_s: float = 300.0,
    token: bytes | None = None,
    token_source: str = "",
    tls: TlsConfig | None = None,
    stop: threading.Event | None = None,
) -> int:
    """Serve until interrupted (or ``stop`` is set); prints "tiersync registry listening on ADDR".
    ``tls``: serve only over TLS (:func:`serve_registry`). With ``token`` every call must prove it
    (``token_source``, e.g. "$TIERSYNC_TOKEN", is named in that line); without one any peer that
    reaches the port may register stores and publish blocks (logged as a warning)."""
    from tiersync.net.registry.agent import REPUBLISH_S
    from tiersync.net.registry.grpc_service import serve_registry

    if isinstance(block_ttl_s, (int, float)) and 0 < block_ttl_s <= REPUBLISH_S:
        raise UsageError(
            f"must exceed {REPUBLISH_S:g} s: store nodes re-publish what they hold that often", argument="block_ttl_s"
        )
    config = RegistryConfig(
        heartbeat_interval_s=min(heartbeat_interval_s, store_ttl_s), store_ttl_s=store_ttl_s, block_ttl_s=block_ttl_s
    )
    backend = make_backend(redis_url, config)
    server = serve_registry(backend, port=port, host=host, token=token, tls=tls)
    kind = "redis" if redis_url else "memory"
    auth = "no token" if token is None else f"token required{f' (from {token_source})' if token_source else ''}"
    if tls is not None:
        auth += ", mutual TLS" if tls.require_peer_cert else ", TLS"
    print(
        f"tiersync registry listening on {server.address} ({kind} backend, store TTL {store_ttl_s:g} s, {auth})",
        flush=True,
    )
    if token is None:
        log.warning(
            "registry %s has no token: any peer that reaches it may register stores and publish", server.address
        )
    stop = stop or threading.Event()
    sweep = getattr(backend, "sweep", None)  # the memory backend drops expired entries on request
    health = _Health(backend, redis_url)
    try:
        health.check()
        while not stop.wait(min(store_ttl_s, HEALTH_INTERVAL_S)):
            health.check()
            if sweep is not None:
                _sweep(sweep)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop(grace=1.0)
        backend.close()
    return 0


def _sweep(sweep: Callable[[], int]) -> None:
    """One sweep of the backend; a failure (Redis down, a script refused) is logged, never fatal:
    expired records are also ignored by every reader, the next sweep drops them."""
    try:
        sweep()
    except TierSyncError as exc:
        log.warning("registry sweep failed: %s", exc)


class _Health:
    """Says when the backend (Redis) becomes unreachable and when it is back, once each: while
    it is down, lookups answer nothing and registrations fail, so the operator must know."""

    def __init__(self, backend: Registry, url: str | None) -> None:
        self.ping = getattr(backend, "ping", None)
        self.url, self.down = (None if url is None else shown_url(url)), False

    def check(self) -> None:
        if self.ping is None:
            return
        try:
            self.ping()
        except TierSyncError as exc:
            if not self.down:
                log.warning(
                    "redis at %s is unreachable (%s): lookups answer nothing and stores cannot "
                    "register until it is back",
                    self.url,
                    exc,
                )
            self.down = True
            return
        if self.down:
            log.warning("redis at %s is reachable again", self.url)
        self.down = False
