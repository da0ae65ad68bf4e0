"""Server process entry points for the transport tests (spawned, loopback only)."""
from __future__ import annotations


def run_block_server(config, blocks, address_q, stop) -> None:
    """Serve ``blocks`` with ``config`` on 127.0.0.1:0; report the address; wait for ``stop``."""
    from tiersync.net.source import MemoryBlockSource
    from tiersync.net.tcp import TcpTransport

    server = TcpTransport(config).serve("127.0.0.1:0", MemoryBlockSource(blocks))
    address_q.put(server.address)
    stop.wait(60)
    server.close()
