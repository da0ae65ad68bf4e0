"""The ``tiersync registry`` process: the gRPC control plane over a memory or Redis backend.

State lives in the backend: with ``--redis`` it survives a restart of this
process; with the memory backend it does not, and store nodes re-register (and
re-publish what they hold) at their next heartbeat.
"""
from __future__ import annotations

import threading

from tiersync.net.registry.base import Registry, RegistryConfig


def make_backend(redis_url: str | None, config: RegistryConfig) -> Registry:
    """A RedisRegistry on ``redis_url``, or a MemoryRegistry when it is None."""
    if redis_url:
        from tiersync.net.registry.redis_backend import RedisRegistry

        return RedisRegistry(redis_url, config)
    from tiersync.net.registry.memory import MemoryRegistry

    return MemoryRegistry(config)


def main(port: int, host: str = "127.0.0.1", redis_url: str | None = None, *, store_ttl_s: float = 900.0,
         block_ttl_s: float = 3600.0, heartbeat_interval_s: float = 300.0,
         stop: threading.Event | None = None) -> int:
    """Serve until interrupted (or ``stop`` is set); prints "tiersync registry listening on ADDR"."""
    from tiersync.net.registry.grpc_service import serve_registry

    config = RegistryConfig(heartbeat_interval_s=min(heartbeat_interval_s, store_ttl_s), store_ttl_s=store_ttl_s,
                            block_ttl_s=block_ttl_s)
    backend = make_backend(redis_url, config)
    server = serve_registry(backend, port=port, host=host)
    kind = "redis" if redis_url else "memory"
    print(f"tiersync registry listening on {server.address} ({kind} backend, store TTL {store_ttl_s:g} s)",
          flush=True)
    stop = stop or threading.Event()
    sweep = getattr(backend, "sweep", None)  # the memory backend drops expired entries on request
    try:
        while not stop.wait(min(store_ttl_s, 60.0)):
            if sweep is not None:
                sweep()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop(grace=1.0)
        backend.close()
    return 0
