"""A store node in its own process for the server tests: ``python _node_child.py CAP NOFILE``.

Serves a 16 MiB node with the test token, ``max_connections=CAP``; lowers its own
RLIMIT_NOFILE to NOFILE first when NOFILE > 0. Prints its address, then serves until stdin
closes.
"""

import resource
import sys

from tiersync.net.config import TcpConfig
from tiersync.net.store_node import StoreNode, StoreNodeServer

TOKEN = b"server-test-token-0123456789"


def main() -> None:
    cap, nofile = int(sys.argv[1]), int(sys.argv[2])
    if nofile > 0:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    node = StoreNode(16 << 20, 1 << 20, config=TcpConfig(token=TOKEN, max_connections=cap, connect_timeout_s=5.0))
    server = StoreNodeServer("127.0.0.1:0", node)
    print(server.address, flush=True)
    sys.stdin.read()
    server.close()
    node.close()


if __name__ == "__main__":
    main()
