"""How the CLI's servers (``metrics --port``, ``store-node``, ``registry``) start and stop.

A flag whose value cannot work on this host (a port in use, an address not here, more memory
than there is, a missing 'net' extra, a bad Redis URL) becomes one :class:`UsageError` naming
the flag as the user typed it (``args.flags``: dest -> flag, built by :mod:`tiersync.cli`);
SIGTERM stops a server as Ctrl-C does, with one "stopped" line on stderr. :func:`layer_flags` fills
the flags not typed from the environment and the config file (:mod:`tiersync.settings`).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

__all__ = [
    "bind_probe",
    "kv_event_flags",
    "kv_events_config",
    "layer_flags",
    "redis_url",
    "starting",
    "stop_on_sigterm",
    "stopped",
]

NET_MODULES = ("grpc", "redis", "cryptography", "zmq", "msgspec")  # what the 'net' extra installs


def layer_flags(
    args: argparse.Namespace,
    section: str,
    defaults: Mapping[str, Any],
    types: Mapping[str, Callable[[str], Any]],
    *,
    required: Collection[str] = (),
    environ: Mapping[str, str] | None = None,
) -> None:
    """Set each flag of ``defaults`` (dest -> default) not typed (None in ``args``) from
    ``$TIERSYNC_<SECTION>_<DEST>``, else the config file's ``[section]`` table, else its default.
    Such a value passes the flag's argparse type (``types``; str otherwise); a bad one is a
    UsageError naming the variable or the file's key, and a required flag set nowhere one
    naming the flag. ``args.flags`` then names each value where it came from, so that a later
    error (a port in use) names the variable or the file's key the value came from."""
    from tiersync.errors import UsageError
    from tiersync.settings import CONFIG_FILE_ENV, env_name, layered

    typed = {dest: getattr(args, dest) for dest in defaults if getattr(args, dest) is not None}
    got = layered(section, defaults, typed, explicit_origin=args.flags.__getitem__, environ=environ)
    for dest, default in defaults.items():
        if dest in typed:
            continue
        if dest in got.values:
            setattr(args, dest, _flag_value(got.values[dest], types.get(dest), got.origins[dest]))
            args.flags = {**args.flags, dest: got.origins[dest]}  # a new dict: the parser's default is shared
        elif dest in required:
            raise UsageError(
                f"required (typed, or ${env_name(section, dest)}, or {dest} in the [{section}] "
                f"table of ${CONFIG_FILE_ENV})",
                argument=args.flags[dest],
            )
        else:
            setattr(args, dest, default)


def _flag_value(value: Any, kind: Callable[[str], Any] | None, origin: str) -> Any:
    """``value`` (a string from the environment; a string or number from the file) as the flag's type."""
    from tiersync.errors import UsageError

    if isinstance(value, bool):  # a TOML true / false: only for a yes/no flag
        value = str(value).lower()
        if kind is None:
            raise UsageError("must be a string or a number", argument=origin)
    if not isinstance(value, (str, int, float)):
        raise UsageError("must be a string or a number", argument=origin)
    if kind is None:
        return str(value)
    try:
        return kind(str(value))
    except argparse.ArgumentTypeError as exc:
        raise UsageError(str(exc), argument=origin) from None


@contextlib.contextmanager
def starting(args: argparse.Namespace, host_dest: str = "host") -> Iterator[None]:
    """Raise a UsageError naming the flag (as typed) for what starting a server raises because of a
    flag's value or this host: a missing 'net' extra, a port in use, an address not here, no memory."""
    from tiersync.errors import CapacityError, UsageError

    try:
        yield
    except ImportError as exc:
        if (exc.name or "").partition(".")[0] not in NET_MODULES:
            raise
        raise UsageError(f"needs the 'net' extra: pip install 'tiersync[net]' ({exc})") from None
    except CapacityError:  # the arena (--capacity bytes) does not fit in memory
        if "capacity" not in args.flags:
            raise
        raise no_memory(args) from None
    except OSError as exc:
        problem = os_problem(exc, args, host_dest)
        if problem is None:
            raise
        raise problem from None
    except RuntimeError as exc:  # gRPC: "Failed to bind to address HOST:PORT; ..." (no errno)
        if "bind" not in str(exc):
            raise
        raise bind_probe(args, host_dest) or cannot_listen(args, host_dest) from None


def os_problem(exc: OSError, args: argparse.Namespace, host_dest: str) -> Exception | None:
    """The UsageError (naming --host/--port/--capacity as typed) behind ``exc``, or None."""
    import errno
    import socket

    from tiersync.errors import UsageError

    host, port, flags = getattr(args, host_dest), args.port, args.flags
    if isinstance(exc, socket.gaierror) or (exc.errno or 0) < 0:  # getaddrinfo's EAI_* codes are negative
        reason = str(exc.strerror).partition(" (while attempting")[0]  # socket.create_server appends the address
        return UsageError(f"cannot listen on {host!r}: {reason}", argument=flags[host_dest])
    if exc.errno == errno.EADDRNOTAVAIL:
        return UsageError(f"{host} is not an address of this host", argument=flags[host_dest])
    if exc.errno == errno.EADDRINUSE:
        return UsageError(f"port {port} on {host} is already in use", argument=flags["port"])
    if exc.errno == errno.EACCES and 0 < port < 1024:
        return UsageError(f"no permission to listen on port {port} (below 1024)", argument=flags["port"])
    if exc.errno == errno.ENOMEM and "capacity" in flags:
        return no_memory(args)
    return None


def cannot_listen(args: argparse.Namespace, host_dest: str) -> Exception:
    """A server refused ``host`` though a plain socket binds there: most likely its spelling."""
    from tiersync.errors import UsageError

    host = getattr(args, host_dest)
    hint = " (write an IPv6 address in brackets, e.g. [::1])" if ":" in host and not host.startswith("[") else ""
    return UsageError(f"cannot listen on {host!r} port {args.port}{hint}", argument=args.flags[host_dest])


def no_memory(args: argparse.Namespace) -> Exception:
    from tiersync.errors import UsageError

    return UsageError(f"{args.capacity} does not fit in this host's memory", argument=args.flags["capacity"])


def bind_probe(args: argparse.Namespace, host_dest: str) -> Exception | None:
    """Why a server cannot bind ``host:port`` (some servers do not say): bind a plain socket there
    and return the UsageError behind its error, or None when it binds."""
    import socket

    host, port = getattr(args, host_dest).strip("[]"), args.port
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(sockaddr)
    except OSError as exc:
        return os_problem(exc, args, host_dest)
    return None


@contextlib.contextmanager
def redis_url(args: argparse.Namespace) -> Iterator[None]:
    """A --redis URL the redis client rejects (a plain ValueError) as a UsageError naming the flag."""
    from tiersync.errors import TierSyncError, UsageError

    try:
        yield
    except ValueError as exc:
        if not args.redis or isinstance(exc, TierSyncError):
            raise
        from tiersync.net.registry.redis_backend import shown_url

        raise UsageError(str(exc), argument=args.flags["redis"], value=shown_url(args.redis)) from None


def stop_on_sigterm() -> threading.Event:
    """An event SIGTERM sets, so that a server shuts down as on Ctrl-C (and exits 0)."""
    import signal

    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():  # signal.signal works only there
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    return stop


def stopped(args: argparse.Namespace, rc: int) -> int:
    print(f"tiersync {args.command}: stopped", file=sys.stderr, flush=True)
    return rc


_KV_EVENTS_FLAGS = {"endpoint": "kv_events_endpoint", "replay_endpoint": "kv_events_replay", "topic": "kv_events_topic"}


def kv_events_config(args: argparse.Namespace) -> Any:
    """The store node's KVEventsConfig from --kv-events-*, or None without an endpoint."""
    if args.kv_events_replay and not args.kv_events_endpoint:
        from tiersync.errors import UsageError

        raise UsageError("needs --kv-events-endpoint too", argument="kv_events_replay")
    if not args.kv_events_endpoint:
        return None
    from tiersync.net.kv_events import KVEventsConfig

    return KVEventsConfig(args.kv_events_endpoint, args.kv_events_replay, args.kv_events_topic or "")


@contextlib.contextmanager
def kv_event_flags() -> Any:
    """KVEventsConfig / publisher errors name their field: report them as the --kv-events-* flag."""
    from tiersync.errors import UsageError

    try:
        yield
    except UsageError as exc:
        if exc.argument not in _KV_EVENTS_FLAGS:
            raise
        raise UsageError(
            exc.message.split(": ", 1)[-1], argument=_KV_EVENTS_FLAGS[exc.argument], **exc.context
        ) from None
