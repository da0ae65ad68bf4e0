"""The ``tiersync store-node`` process: serve, register, publish KV events, until stopped."""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING

from tiersync.cli_servers import stop_on_sigterm
from tiersync.net.registry.redis_backend import shown_url
from tiersync.net.store_node import StoreNodeServer, attach_events, attach_registry, default_advertise, serve
from tiersync.sizes import parse_size

if TYPE_CHECKING:  # the 'net' extra's modules load only when used
    from tiersync.net.kv_events import KVEventPublisher, KVEventsConfig
    from tiersync.net.registry.agent import StoreAgent
    from tiersync.net.tls import TlsConfig

__all__ = ["run_store_node"]


def run_store_node(
    capacity: str,
    port: int,
    host: str = "127.0.0.1",
    token: bytes | str | None = None,
    block_size: str = "1MiB",
    stop: threading.Event | None = None,
    *,
    registry: str | None = None,
    store_id: str | None = None,
    pool_group: str = "",
    heartbeat_s: float = 300.0,
    advertise: str | None = None,
    kv_events: KVEventsConfig | None = None,
    tls: TlsConfig | None = None,
) -> int:
    """The ``tiersync store-node`` process: print the address, serve until interrupted (or SIGTERM).

    ``registry``: "host:port" of ``tiersync registry`` (or "redis://..."): register as
    ``store_id`` (default "HOST:PORT" of ``advertise``) and heartbeat every ``heartbeat_s``,
    proving ``token`` on every gRPC registry call too.
    ``kv_events``: publish a vLLM KV event stream (:func:`attach_events`); an empty topic
    becomes ``kv@<store id>@*``. ``tls``: serve over TLS, and verify a gRPC registry and the
    writers the node pulls from with its CA (presenting its certificate to them).
    """
    nbytes = parse_size(block_size)
    server = serve(parse_size(capacity), f"{host}:{port}", token=token, block_nbytes=nbytes, tls=tls)
    stop = stop or stop_on_sigterm()
    agent = reg = events = None
    try:
        if kv_events is not None:
            if not kv_events.topic:  # the id the registry knows the node by
                node_id = store_id or advertise or default_advertise(server.address)
                kv_events = dataclasses.replace(kv_events, topic=f"kv@{node_id}@*")
            events = attach_events(server, kv_events)
        if registry:
            from tiersync.net.registry import open_registry
            from tiersync.net.registry.agent import AgentConfig
            from tiersync.net.registry.base import RegistryConfig

            where = advertise or default_advertise(server.address)
            grpc_tls = None if registry.startswith(("redis://", "rediss://", "unix://")) else tls
            reg = open_registry(registry, RegistryConfig(token=token, tls=grpc_tls))  # one secret, one CA
            agent = attach_registry(server, reg, AgentConfig(store_id or where, where, pool_group, heartbeat_s))
        print(_listening(server, agent, registry, events), flush=True)
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        if events is not None:
            events.close()
        if agent is not None:
            agent.close()
        if reg is not None:
            reg.close()
        server.close()
        server.node.close()
    return 0


def _listening(
    server: StoreNodeServer, agent: StoreAgent | None, registry: str | None, events: KVEventPublisher | None
) -> str:
    """The store node's one line: where it listens, and where it registered and publishes."""
    tls = server.config.tls
    line = (
        f"tiersync store-node listening on {server.address} "
        f"({server.node.arena.num_blocks} blocks x {server.node.arena.block_nbytes} B"
        f"{'' if tls is None else ', mutual TLS' if tls.require_peer_cert else ', TLS'})"
    )
    if agent is not None:
        line += f" registered as {agent.config.store_id} in {shown_url(str(registry))}"
    if events is not None:
        line += f"; KV events on {events.endpoint} (replay {events.replay_endpoint}, topic {events.config.topic})"
    return line
