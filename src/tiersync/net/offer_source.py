"""Where a store node pulls an OFFER's blocks from: the IP the writer connects from.

A writer serves its blocks on a listener of its own and names it in the OFFER ("host:port").
The node dials only the IP it sees the writer's connection come from, so an authenticated
writer cannot make the node connect anywhere else (its scanner, its relay).
"""

from __future__ import annotations

import ipaddress
import logging

from tiersync.net import events as ev
from tiersync.net.config import parse_address
from tiersync.net.source import BlockError

__all__ = ["writer_address"]

log = logging.getLogger(__name__)


def writer_address(source: str, peer: str | None) -> str:
    """The address to pull an OFFER's blocks from: the IP the writer's connection comes from
    (``peer``, "ip:port") and the port ``source`` ("host:port") names. An empty host takes that
    IP; any other host must be that IP written out, so an authenticated writer cannot make the
    node connect anywhere else. BlockError(BAD_REQUEST, why) otherwise.
    """
    host, sep, port = source.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise BlockError(ev.ErrorCode.BAD_REQUEST, f"OFFER source {source!r} is not 'host:port'")
    seen = _ip(parse_address(peer)[0]) if peer is not None else None
    if seen is None:
        raise BlockError(ev.ErrorCode.BAD_REQUEST, "the writer's own address is unknown")
    named = _ip(host.strip("[]")) if host else seen
    if named is None or named.packed != seen.packed:  # scopes aside: the node dials the one it saw
        raise BlockError(
            ev.ErrorCode.BAD_REQUEST,
            f"OFFER source host {host!r} is not {seen}, the address this connection comes from "
            "(the node dials only that one: serve on it, or connect from it)",
        )
    return f"[{seen}]:{port}" if seen.version == 6 else f"{seen}:{port}"


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``text`` as an IP address (an IPv4-mapped IPv6 one as IPv4), or None when it is not one."""
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return mapped or ip
