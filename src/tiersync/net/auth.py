"""Shared-secret HMAC challenge-response (mutual), independent of I/O.

Client sends a nonce ``cn``; server answers its nonce ``sn`` and
``server_proof = HMAC-SHA256(token, "tiersync-server" | cn | sn)``; client checks
it and answers ``client_proof = HMAC-SHA256(token, "tiersync-client" | sn | cn)``.
Without a token a side sends an empty proof; a side *with* a token refuses an
empty or wrong proof, so a peer lacking the token is always refused.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from tiersync.net.events import NONCE_SIZE


def new_nonce() -> bytes:
    return os.urandom(NONCE_SIZE)


def server_proof(token: bytes | None, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """The server's proof, or b"" when ``token`` is None."""
    if token is None:
        return b""
    return hmac.new(token, b"tiersync-server" + client_nonce + server_nonce, hashlib.sha256).digest()


def client_proof(token: bytes | None, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """The client's proof, or b"" when ``token`` is None."""
    if token is None:
        return b""
    return hmac.new(token, b"tiersync-client" + server_nonce + client_nonce, hashlib.sha256).digest()


def proof_ok(expected: bytes, got: bytes) -> bool:
    """True when ``got`` matches; an empty ``expected`` (no token here) accepts anything."""
    if not expected:
        return True
    return hmac.compare_digest(expected, got)
