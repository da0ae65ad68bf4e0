"""The TLS flags of the CLI's servers (``store-node``, ``registry``).

``--tls-cert``, ``--tls-key`` and ``--tls-ca`` turn TLS on together: the server presents the
certificate, and ``--tls-ca`` is the CA that signs its peers' certificates (clients' under
``--tls-require-client-cert``; a store node also verifies with it the gRPC registry it
registers with and the writers it pulls from). Each file is read once before anything
starts; a missing, unreadable or mismatched one is a UsageError naming the flag as typed
(or the variable or config key it came from, ``args.flags``).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tiersync.net.tls import TlsConfig

__all__ = ["TLS_DEFAULTS", "tls_config", "tls_flags"]

TLS_DEFAULTS: dict[str, Any] = {"tls_cert": None, "tls_key": None, "tls_ca": None}  # for layer_flags
_FILES = ("tls_cert", "tls_key", "tls_ca")


def tls_flags(parser: argparse.ArgumentParser) -> None:
    """Add the four TLS flags to ``parser``."""
    parser.add_argument("--tls-cert", help="serve over TLS with this certificate chain (PEM; with --tls-key, --tls-ca)")
    parser.add_argument("--tls-key", help="the private key of --tls-cert (PEM)")
    parser.add_argument("--tls-ca", help="the CA (PEM) that signs the peers' certificates")
    parser.add_argument(
        "--tls-require-client-cert",
        action="store_true",
        help="refuse clients without a certificate signed by --tls-ca (mutual TLS)",
    )


def tls_config(args: argparse.Namespace) -> TlsConfig | None:
    """The TlsConfig the TLS flags name, None without them; every file checked first."""
    from tiersync.errors import UsageError
    from tiersync.net.tls import TlsConfig

    flags = getattr(args, "flags", {})
    name = {dest: flags.get(dest, "--" + dest.replace("_", "-")) for dest in (*_FILES, "tls_require_client_cert")}
    given = [dest for dest in _FILES if getattr(args, dest) is not None]
    if not given:
        if args.tls_require_client_cert:
            raise UsageError("needs --tls-cert, --tls-key and --tls-ca", argument=name["tls_require_client_cert"])
        return None
    for dest in _FILES:
        if dest not in given:
            raise UsageError("TLS takes --tls-cert, --tls-key and --tls-ca together", argument=name[dest])
    _check_files(args, name)
    return TlsConfig(args.tls_ca, args.tls_cert, args.tls_key, require_peer_cert=args.tls_require_client_cert)


def _check_files(args: argparse.Namespace, name: dict[str, str]) -> None:
    """Load the files as the server will: each failure a UsageError naming its flag."""
    import ssl

    from tiersync.errors import UsageError

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    for dest in _FILES:
        try:
            with open(getattr(args, dest), "rb"):
                pass
        except OSError as exc:
            raise UsageError(f"cannot read {getattr(args, dest)}: {exc.strerror}", argument=name[dest]) from None
    try:
        ctx.load_cert_chain(args.tls_cert, args.tls_key)
    except ssl.SSLError as exc:
        problem = f"{args.tls_cert} and {args.tls_key} are not a PEM certificate and its key ({exc.reason})"
        raise UsageError(problem, argument=name["tls_cert"]) from None
    try:
        ctx.load_verify_locations(args.tls_ca)
    except ssl.SSLError as exc:
        raise UsageError(f"{args.tls_ca} is not a PEM CA certificate ({exc.reason})", argument=name["tls_ca"]) from None
