"""The ``tiersync`` command.

Subcommands::

    tiersync bench d2h|h2d [--quick] [--json] [--workers N]   time block copies
    tiersync shm list [--dir D] [--json]                      segments in /dev/shm
    tiersync shm reclaim PATH...                              unlink dead segments
    tiersync demo [--quick] [--json]                          the end-to-end demo
    tiersync metrics [--port P]                               print or serve metrics
    tiersync store-node --capacity 8GiB --port N [--token T]  serve host DRAM to peers
                        [--registry HOST:PORT] [--heartbeat-s S]  ... and register there
    tiersync registry --port N [--redis URL] [--token-file F] the global block registry (gRPC)
        (both: [--tls-cert F --tls-key F --tls-ca F [--tls-require-client-cert]], see cli_tls)
    tiersync router --prefill URL --decode URL --port N       prefill -> decode before vLLM servers

``store-node`` reads each flag not typed from ``$TIERSYNC_STORE_NODE_<FLAG>``, else from the
``[store_node]`` table of the config file named by ``$TIERSYNC_CONFIG_FILE`` (:mod:`tiersync.settings`).

The servers (``metrics --port``, ``store-node``, ``registry``, ``router``) stop on Ctrl-C or SIGTERM alike:
one "stopped" line on stderr, exit 0. A flag whose value cannot work here (a port in use, an
address not on this host, more memory than there is) is one line naming the flag, exit 2.

Exit status: 0 success; 1 a tiersync error; 2 bad usage; 3 a bench refused to
report because its byte-exact round trip failed. Importing this module is
cheap: each subcommand imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from tiersync.cli_servers import (
    bind_probe,
    kv_event_flags,
    kv_events_config,
    layer_flags,
    redis_url,
    starting,
    stop_on_sigterm,
    stopped,
)
from tiersync.cli_shm import add_shm
from tiersync.cli_tls import TLS_DEFAULTS, TLS_TYPES, tls_config, tls_flags

EXIT_ERROR, EXIT_USAGE, EXIT_REFUSED = 1, 2, 3
BENCH_SUITES = ("d2h", "h2d", "storage", "h2h", "pd", "registry", "weights", "serve", "workload")
# ... in step with tiersync.bench.SUITES (checked by the tests)
TINY_ENV = "TIERSYNC_BENCH_TINY"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; each subcommand sets ``func(args) -> int``."""
    p = argparse.ArgumentParser(prog="tiersync", description="Move LLM KV caches between tiers, fast.")
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    _add_bench(sub)
    add_shm(sub)
    d = sub.add_parser("demo", help="run the end-to-end demo")
    d.add_argument("--quick", action="store_true", help="a small, fast run")
    d.add_argument("--json", action="store_true", help="print one JSON object")
    d.add_argument("--storage-dir", default=None, help="keep the disk tier here (default: a temp dir)")
    d.set_defaults(func=cmd_demo)
    m = sub.add_parser("metrics", help="print the Prometheus metrics, or serve them with --port")
    m.add_argument("--port", type=_port, default=None, help="serve /metrics on this port until interrupted")
    m.add_argument("--addr", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    m.set_defaults(func=cmd_metrics)
    _add_store_node(sub)
    _add_registry(sub)
    _add_router(sub)
    for command in sub.choices.values():  # UsageError(argument=dest) is reported as the flag typed
        command.set_defaults(flags=_flags(command))
    return p


STORE_NODE_DEFAULTS = {
    "capacity": None,
    "port": None,
    "host": "127.0.0.1",
    "token_file": None,
    "token": None,
    "block_size": "1MiB",
    "registry": None,
    "store_id": None,
    "advertise": None,
    "pool_group": "",
    "heartbeat_s": 300.0,
    "kv_events_endpoint": None,
    "kv_events_replay": None,
    "kv_events_topic": "",
    **TLS_DEFAULTS,
}  # None: required (capacity, port) or unset


def _add_store_node(sub: Any) -> None:
    n = sub.add_parser(
        "store-node",
        help="serve host DRAM to remote readers and writers",
        description="Each flag not typed is read from $TIERSYNC_STORE_NODE_<FLAG> (e.g. "
        "TIERSYNC_STORE_NODE_BLOCK_SIZE), else from the [store_node] table of the "
        'config file named by $TIERSYNC_CONFIG_FILE (block_size = "2MiB").',
    )
    n.add_argument("--capacity", type=_size, help="host arena size, e.g. 8GiB (required)")
    n.add_argument("--port", type=_port, help="TCP port (0 picks one; printed) (required)")
    n.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    n.add_argument(
        "--token-file", help="file holding the shared secret peers must prove (>= 16 bytes; default: $TIERSYNC_TOKEN)"
    )
    n.add_argument("--token", help="the secret itself (readable by every local user through ps: prefer --token-file)")
    n.add_argument("--block-size", type=_size, help="bytes per host block (default 1MiB)")
    n.add_argument("--registry", help="register with this registry: HOST:PORT (gRPC) or redis://...")
    n.add_argument("--store-id", help="id in the registry (default: the advertised address)")
    n.add_argument("--advertise", help="HOST:PORT peers should dial (default: the bound address)")
    n.add_argument("--pool-group", help="placement group (same group is preferred)")
    n.add_argument("--heartbeat-s", type=_seconds, help="registry heartbeat interval (default 300)")
    n.add_argument("--kv-events-endpoint", help="publish vLLM-format KV events on this ZMQ address, e.g. tcp://*:5557")
    n.add_argument("--kv-events-replay", help="ZMQ address of the events' replay socket, e.g. tcp://*:5558")
    n.add_argument("--kv-events-topic", help="topic of every event message (default kv@<store id>@*)")
    tls_flags(n)
    n.set_defaults(func=cmd_store_node)


def _add_registry(sub: Any) -> None:
    r = sub.add_parser("registry", help="serve the global block registry (gRPC)")
    r.add_argument("--port", type=_port, required=True, help="TCP port (0 picks one; printed)")
    r.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    r.add_argument("--redis", default=None, help="keep the state in Redis at this URL (default: in memory)")
    r.add_argument("--store-ttl-s", type=_seconds, default=900.0, help="a store unheard for this long is dead")
    r.add_argument("--block-ttl-s", type=_seconds, default=3600.0, help="an ownership entry not re-published expires")
    r.add_argument(
        "--token-file",
        help="file holding the shared secret every call must prove (>= 16 bytes; default: $TIERSYNC_TOKEN)",
    )
    tls_flags(r)
    r.set_defaults(func=cmd_registry)


def _add_router(sub: Any) -> None:
    r = sub.add_parser(
        "router",
        help="prefill -> decode in front of vLLM's OpenAI servers",
        description="Clients talk to it as to one OpenAI server; each request is prefilled on a "
        "--prefill server (kv_producer), then decoded on a --decode server "
        "(kv_consumer) that pulls the prompt's KV.",
    )
    r.add_argument("--prefill", action="append", required=True, help="prefill server URL (repeat for several)")
    r.add_argument("--decode", action="append", required=True, help="decode server URL (repeat for several)")
    r.add_argument("--port", type=_port, required=True, help="TCP port (0 picks one; printed)")
    r.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    r.add_argument("--timeout-s", type=_seconds, default=600.0, help="bound of one upstream request (default 600)")
    r.add_argument("--client-timeout-s", type=_seconds, default=30.0, help="a client's whole request (default 30)")
    r.add_argument("--max-body", type=_size, default="64MiB", help="largest request accepted (default 64MiB)")
    r.add_argument("--max-bodies", type=_size, default="256MiB", help="request bytes held at once (default 256MiB)")
    r.add_argument("--max-connections", type=_count, default=256, help="clients served at once (default 256)")
    r.add_argument("--upstream-ca", help="PEM file of the CAs that verify https:// upstreams (default: the system's)")
    r.set_defaults(func=cmd_router)


def _flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    """dest -> the flag a user types (its longest option string), for every option of ``parser``."""
    return {a.dest: max(a.option_strings, key=len) for a in parser._actions if a.option_strings}


# -- argparse types: a bad value is reported as "argument --flag: ..." (exit 2) -----------
def _port(text: str) -> int:
    if not text.strip().isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [0, 65535] (0 picks one), not {text!r}")
    return int(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < 1e9:  # nan and inf too: they break every timer they reach
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0 (finite), not {text!r}")
    return value


def _count(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, not {text!r}")
    return int(text)


def _size(text: str) -> str:
    """A size such as 8GiB, checked here and passed on as typed."""
    from tiersync.errors import UsageError
    from tiersync.sizes import parse_size

    try:
        parse_size(text)
    except UsageError:
        raise argparse.ArgumentTypeError(f"must be a size such as 8GiB or 512MiB, not {text!r}") from None
    return text


def _add_bench(sub: Any) -> None:
    b = sub.add_parser(
        "bench",
        help="run a benchmark suite",
        description="Time a suite against its baselines, after a byte-exact round trip.",
    )
    b.add_argument("suite", choices=BENCH_SUITES)
    b.add_argument("--quick", action="store_true", help="smaller shapes, 5 timed iterations (< 60 s)")
    b.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    b.add_argument("--workers", type=int, default=2, help="copy threads of the transfer engine (default 2)")
    b.add_argument("--iterations", type=int, default=None, help="timed iterations (default 20, quick 5)")
    b.add_argument("--warmups", type=int, default=None, help="warm-up iterations (default 3)")
    b.add_argument("--seed", type=int, default=0, help="seed of the block ids and data")
    b.add_argument("--cases", default=None, help="run only the cases whose name contains this text")
    b.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # tests: a few MiB
    b.add_argument("--inject-corruption", action="store_true", help=argparse.SUPPRESS)  # tests only
    b.set_defaults(func=cmd_bench)


# -- subcommands -------------------------------------------------------------
def cmd_bench(args: argparse.Namespace) -> int:
    """Run one suite; print its JSON object or table. RoundTripError propagates (exit 3)."""
    from tiersync.bench import run_suite
    from tiersync.bench.common import BenchConfig, dump_json, render_table

    config = BenchConfig(
        suite=args.suite,
        quick=args.quick,
        tiny=args.tiny or os.environ.get(TINY_ENV) == "1",
        workers=args.workers,
        iterations=args.iterations,
        warmups=args.warmups,
        seed=args.seed,
        inject_corruption=args.inject_corruption,
        cases=args.cases,
        progress=not args.json and sys.stderr.isatty(),
    )
    rep = run_suite(config)
    print(dump_json(rep) if args.json else render_table(rep))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Forward ``--quick``/``--json``/``--storage-dir`` (as an argv list) to ``tiersync.demo.main``."""
    from tiersync import demo

    argv = [flag for flag, on in (("--quick", args.quick), ("--json", args.json)) if on]
    if args.storage_dir is not None:
        argv += ["--storage-dir", args.storage_dir]
    rc = demo.main(argv)
    return rc if isinstance(rc, int) else 0


def cmd_metrics(args: argparse.Namespace) -> int:
    from tiersync.telemetry import Metrics, start_exporter

    metrics = Metrics.default()
    if args.port is None:
        sys.stdout.write(metrics.render().decode())
        return 0
    stop = stop_on_sigterm()
    with starting(args, host_dest="addr"):
        server = start_exporter(args.port, addr=args.addr, metrics=metrics)
    print(f"serving http://{args.addr}:{server.server_port}/metrics (Ctrl-C to stop)", file=sys.stderr)
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        server.server_close()
    return stopped(args, 0)


def cmd_store_node(args: argparse.Namespace) -> int:
    from tiersync.cli_store_node import run_store_node
    from tiersync.net.config import coerce_token, token_from

    types = {"capacity": _size, "port": _port, "block_size": _size, "heartbeat_s": _seconds, **TLS_TYPES}
    layer_flags(args, "store_node", STORE_NODE_DEFAULTS, types, required=("capacity", "port"), environ=os.environ)
    flags = args.flags  # where each value came from: the flag, $TIERSYNC_STORE_NODE_<FLAG> or the file
    token = (
        coerce_token(args.token, flags["token"])
        if args.token is not None
        else token_from(args.token_file, argument=flags["token_file"])
    )
    tls = tls_config(args)
    with starting(args), kv_event_flags():  # the node stops on SIGTERM itself
        rc = run_store_node(
            args.capacity,
            args.port,
            args.host,
            token,
            args.block_size,
            registry=args.registry,
            store_id=args.store_id,
            pool_group=args.pool_group,
            heartbeat_s=args.heartbeat_s,
            advertise=args.advertise,
            kv_events=kv_events_config(args),
            tls=tls,
        )
    return stopped(args, rc)


def cmd_registry(args: argparse.Namespace) -> int:
    from tiersync.net.config import token_from
    from tiersync.net.registry.process import main as registry_main

    token, tls = token_from(args.token_file, argument="--token-file"), tls_config(args)
    problem = bind_probe(args, "host")  # before gRPC, which logs its own bind failure first
    if problem is not None:
        raise problem
    stop = stop_on_sigterm()
    with starting(args), redis_url(args):
        rc = registry_main(
            args.port,
            args.host,
            args.redis,
            store_ttl_s=args.store_ttl_s,
            block_ttl_s=args.block_ttl_s,
            token=token,
            token_source="--token-file" if args.token_file is not None else "$TIERSYNC_TOKEN",
            tls=tls,
            stop=stop,
        )
    return stopped(args, rc)


def cmd_router(args: argparse.Namespace) -> int:
    from tiersync.cli_router import run_router

    return run_router(args)


# -- entry point -------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from tiersync import __version__

        print(f"tiersync {__version__}")
        return 0
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    from tiersync.errors import IntegrityError, TierSyncError, UsageError

    name = f"tiersync {args.command}"
    try:
        return args.func(args)
    except IntegrityError as exc:
        print(f"{name}: REFUSED: {exc}", file=sys.stderr)
        if getattr(args, "json", False):
            import json

            print(json.dumps({"suite": getattr(args, "suite", None), "refused": True, "error": str(exc)}))
        return EXIT_REFUSED
    except UsageError as exc:
        print(f"{name}: {_as_typed(exc, getattr(args, 'flags', {}))}", file=sys.stderr)
        return EXIT_USAGE
    except TierSyncError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `tiersync bench d2h | head`: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _as_typed(exc: Exception, flags: dict[str, str]) -> str:
    """``exc`` as one line, an internal argument name (``block_ttl_s``) replaced by its flag (``--block-ttl-s``)."""
    text, argument = str(exc), getattr(exc, "argument", None)
    if argument not in flags or not text.startswith(f"{argument}: "):
        return text
    return flags[argument] + text[len(argument) :]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
