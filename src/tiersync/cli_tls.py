"""The TLS flags of the CLI's servers (``store-node``, ``registry``).

``--tls-cert``, ``--tls-key`` and ``--tls-ca`` turn TLS on together: the server presents the
certificate, and ``--tls-ca`` is the CA that signs its peers' certificates (clients' under
``--tls-require-client-cert``; a store node also verifies with it the gRPC registry it
registers with and the writers it pulls from; the writers' certificates must then name the
IP the node dials them at). Each file is checked before anything starts (a regular file,
PEM, the key unencrypted and matching the certificate); a bad one is a UsageError naming the
flag as typed (or the variable or config key it came from, ``args.flags``). A store node
layers them (``$TIERSYNC_STORE_NODE_TLS_CERT``, ``tls_require_client_cert = true`` in its
table) like its other flags.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tiersync.net.tls import TlsConfig

__all__ = ["TLS_DEFAULTS", "TLS_TYPES", "tls_config", "tls_flags"]

TLS_DEFAULTS: dict[str, Any] = {"tls_cert": None, "tls_key": None, "tls_ca": None, "tls_require_client_cert": False}
_FILES = ("tls_cert", "tls_key", "tls_ca")


def tls_flags(parser: argparse.ArgumentParser) -> None:
    """Add the four TLS flags to ``parser``."""
    parser.add_argument("--tls-cert", help="serve over TLS with this certificate chain (PEM; with --tls-key, --tls-ca)")
    parser.add_argument("--tls-key", help="the private key of --tls-cert (PEM)")
    parser.add_argument("--tls-ca", help="the CA (PEM) that signs the peers' certificates")
    parser.add_argument(
        "--tls-require-client-cert",
        action="store_const",
        const=True,
        default=None,  # None: not typed (a store node may take it from its variable or file)
        help="refuse clients without a certificate signed by --tls-ca (mutual TLS)",
    )


def _yes_no(text: str) -> bool:
    """A yes/no flag's value from the environment or the config file."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"must be true or false, not {text!r}")


TLS_TYPES = {"tls_require_client_cert": _yes_no}  # for layer_flags


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
    return TlsConfig(args.tls_ca, args.tls_cert, args.tls_key, require_peer_cert=bool(args.tls_require_client_cert))


def _check_files(args: argparse.Namespace, name: dict[str, str]) -> None:
    """Load the files as the server will: each failure a UsageError naming its flag."""
    import ssl

    from tiersync.errors import UsageError

    for dest in _FILES:
        _regular(getattr(args, dest), name[dest])
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    for dest in ("tls_cert", "tls_ca"):
        try:
            probe.load_verify_locations(getattr(args, dest))
        except ssl.SSLError as exc:
            raise UsageError(
                f"{getattr(args, dest)} is not a PEM certificate ({exc.reason})", argument=name[dest]
            ) from None
    try:  # an empty passphrase: an encrypted key fails here instead of prompting
        probe.load_cert_chain(args.tls_cert, args.tls_key, password=b"")
    except ssl.SSLError as exc:
        problem = f"{args.tls_key} is not the unencrypted PEM key of {args.tls_cert} ({exc.reason})"
        raise UsageError(problem, argument=name["tls_key"]) from None


def _regular(path: str, flag: str) -> None:
    """A readable regular file (a FIFO or a pipe is refused without blocking or draining it)."""
    import os
    import stat

    from tiersync.errors import UsageError

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}", argument=flag) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UsageError(f"{path} is not a regular file", argument=flag)
    finally:
        os.close(fd)
