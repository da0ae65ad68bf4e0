"""Global registry: block hash -> owner stores, store id -> address/capacity/pool group.

One interface (:class:`~tiersync.net.registry.base.Registry`), backends:
:class:`~tiersync.net.registry.memory.MemoryRegistry` (embedded default),
:class:`~tiersync.net.registry.redis_backend.RedisRegistry`, and the gRPC
control plane (:func:`~tiersync.net.registry.grpc_service.serve_registry`,
:class:`~tiersync.net.registry.grpc_service.RegistryClient`). Importing this
package imports neither grpc nor redis.
"""
