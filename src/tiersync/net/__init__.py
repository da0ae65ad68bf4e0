"""Networking: a sans-IO wire protocol, transports (TCP) and the global registry.

Importing this package is cheap: it imports nothing beyond the standard library
and tiersync's own error family. Import the piece you need, e.g.
``from tiersync.net.protocol import Connection`` or
``from tiersync.net.tcp import TcpTransport``. gRPC and Redis are imported only
inside :mod:`tiersync.net.registry.grpc_service` and
:mod:`tiersync.net.registry.redis_backend`.
"""
