"""What a store node's process attaches to its node: the registry's agent, a KV event stream.

:func:`attach_registry` registers the node and advertises the keys it stores; :func:`attach_events`
publishes them as vLLM KV events; :func:`default_advertise` is the address it goes by.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

from tiersync.net.config import parse_address

if TYPE_CHECKING:
    from tiersync.net.kv_events import KVEventPublisher, KVEventsConfig
    from tiersync.net.registry.agent import AgentConfig, StoreAgent
    from tiersync.net.registry.base import Registry
    from tiersync.net.store_node import StoreNodeServer

__all__ = ["attach_events", "attach_registry", "default_advertise"]


def attach_registry(server: StoreNodeServer, registry: Registry, config: AgentConfig) -> StoreAgent:
    """Register ``server``'s node in ``registry``, heartbeat, advertise what it stores; returns the started agent."""
    from tiersync.net.registry.agent import StoreAgent

    node = server.node
    agent = StoreAgent(
        registry,
        config,
        free_blocks=lambda: node.free_blocks,
        held_keys=node.held_keys,
        capacity_blocks=node.arena.num_blocks,
    )
    node.add_listener(agent.announce)
    agent.start()
    return agent


def attach_events(server: StoreNodeServer, config: KVEventsConfig) -> KVEventPublisher:
    """Publish ``server``'s node as a vLLM KV event stream: ``AllBlocksCleared`` first (a
    started node holds nothing, whatever a router remembers of an earlier one), then one
    ``BlockStored`` (medium ``CPU``, the registry's 16-byte keys as hashes) per committed
    write. The node never evicts, so there is no ``BlockRemoved``. Token ids are not known to
    a node (writers offer keys): routers that index tiersync keys (the registry's) use them."""
    from tiersync.net.kv_events import KVEventPublisher, all_cleared, block_stored

    publisher = KVEventPublisher(config)
    publisher.publish([all_cleared()])
    server.node.add_listener(lambda keys: publisher.publish([block_stored(keys, "CPU")]))
    return publisher


def default_advertise(address: str) -> str:
    """``address`` itself, or this host's name with its port when it is a wildcard bind."""
    host, port = parse_address(address)
    return f"{socket.gethostname()}:{port}" if host in ("0.0.0.0", "::", "") else address
