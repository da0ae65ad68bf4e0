"""The ``tiersync router`` process: prefill -> decode in front of vLLM's OpenAI servers, until stopped."""

from __future__ import annotations

import argparse
import threading

from tiersync.cli_servers import starting, stop_on_sigterm, stopped
from tiersync.sizes import parse_size

__all__ = ["run_router"]


def run_router(args: argparse.Namespace) -> int:
    """Serve ``args`` (the parsed ``tiersync router`` flags) until Ctrl-C or SIGTERM. A bad
    value is a UsageError naming the config field, which the CLI reports as the flag typed."""
    from tiersync.integrations.router import Router, RouterConfig

    config = RouterConfig(
        tuple(args.prefill),
        tuple(args.decode),
        timeout_s=args.timeout_s,
        client_timeout_s=args.client_timeout_s,
        max_body=parse_size(args.max_body),
        max_bodies=parse_size(args.max_bodies),
        max_connections=args.max_connections,
        upstream_ca=args.upstream_ca,
    )
    stop = stop_on_sigterm()
    with starting(args):
        router = Router(config, args.host, args.port)
    print(
        f"tiersync router listening on {router.address} (prefill {', '.join(config.prefill)}; "
        f"decode {', '.join(config.decode)})",
        flush=True,
    )
    thread = threading.Thread(target=router.serve_forever, name="tiersync-router", daemon=True)
    thread.start()
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        router.close()
    return stopped(args, 0)
