"""Network errors: subclasses of :class:`tiersync.errors.RemoteError` (peer's fault).

- :class:`ProtocolError` — the peer sent bytes that violate the wire protocol
  (bad magic/version, checksum, unknown op, oversize, malformed metadata, an op
  not allowed in the current state, EOF inside a frame). ``fault`` says which.
- :class:`AuthError` — the peer failed the token or TLS check (or refused ours).
- :class:`NetTimeoutError` — an operation ran past its deadline; also a
  :class:`TimeoutError`.
- :class:`PeerClosedError` — the peer closed the connection or sent a fatal ERROR.

Local misuse (wrong state, bad argument) raises :class:`tiersync.errors.UsageError`.
"""

from __future__ import annotations

import enum
import logging
from typing import Any

from tiersync.errors import RemoteError


class ProtocolFault(enum.Enum):
    """Why a frame stream was rejected."""

    BAD_MAGIC = "bad_magic"
    BAD_VERSION = "bad_version"
    BAD_CHECKSUM = "bad_checksum"
    UNKNOWN_OP = "unknown_op"
    OVERSIZE = "oversize"
    MALFORMED = "malformed"
    UNEXPECTED = "unexpected"
    TRUNCATED = "truncated"


class ProtocolError(RemoteError):
    """The peer violated the wire protocol. ``fault`` is a :class:`ProtocolFault`."""

    def __init__(self, message: str, *, fault: ProtocolFault, peer: str | None = None, **context: Any) -> None:
        self.fault = fault
        super().__init__(message, peer=peer, fault=fault.value, **context)


class AuthError(RemoteError):
    """Authentication failed: wrong/missing token, bad proof, or a TLS handshake failure."""


def log_level(exc: BaseException) -> int:
    """How loudly a client logs a failed link: a refused token or TLS check is a configuration
    fault someone must see (WARNING); a peer that is busy, gone or slow is routine (INFO)."""
    return logging.WARNING if isinstance(exc, AuthError) else logging.INFO


class NetTimeoutError(RemoteError, TimeoutError):
    """A network operation exceeded its deadline. ``peer`` names the address."""


class PeerClosedError(RemoteError):
    """The peer closed the connection (or ended it with a fatal ERROR frame)."""


class RequestError(RemoteError):
    """The peer answered a request with an ERROR frame. ``code`` is its ErrorCode."""

    def __init__(self, message: str, *, code: object, peer: str | None = None, **context: Any) -> None:
        self.code = code
        super().__init__(message, peer=peer, code=getattr(code, "name", code), **context)
