"""Global registry: block hash -> owner stores, store id -> address/capacity/pool group.

One interface (:class:`~tiersync.net.registry.base.Registry`), backends:
:class:`~tiersync.net.registry.memory.MemoryRegistry` (embedded default),
:class:`~tiersync.net.registry.redis_backend.RedisRegistry`, and the gRPC
control plane (:func:`~tiersync.net.registry.grpc_service.serve_registry`,
:class:`~tiersync.net.registry.grpc_service.RegistryClient`). Importing this
package imports neither grpc nor redis.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tiersync.net.registry.base import Registry, RegistryConfig


def open_registry(spec: str, config: RegistryConfig | None = None) -> Registry:
    """The registry named by ``spec``: "redis://..." (Redis, directly) or "host:port" (gRPC service).

    Nothing is contacted yet; both kinds answer lookups with a shorter answer on an
    outage. Raises UsageError when ``spec`` is neither.
    """
    from tiersync.errors import UsageError
    from tiersync.net.tcp import parse_address

    if spec.startswith(("redis://", "rediss://", "unix://")):
        from tiersync.net.registry.redis_backend import RedisRegistry

        if config is not None and config.tls is not None:  # Redis takes TLS from its URL, not from here
            raise UsageError("a Redis registry takes TLS as rediss://, not config.tls", argument="registry")
        return RedisRegistry(spec, config)
    try:
        parse_address(spec)
    except UsageError:
        raise UsageError(
            "must be 'host:port' (gRPC registry) or 'redis://...'", argument="registry", value=spec
        ) from None
    from tiersync.net.registry.grpc_service import RegistryClient

    return RegistryClient(spec, config)
