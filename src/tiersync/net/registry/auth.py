"""Proof of the shared token on every gRPC registry call (no grpc import here).

A unary call has no session to run the wire stack's challenge on, so each call carries its own
proof in the metadata entry :data:`METADATA_KEY`::

    v1:<unix ms>:<16-byte nonce, hex>:<HMAC-SHA256(token, context), hex>

where the context binds the method, the time, the nonce and the SHA-256 of the request bytes.
The server recomputes it (:func:`check_proof`) and refuses a missing, malformed, forged or
stale proof (more than ``window_s`` from its clock, either way). What it does not stop: a call
someone recorded replayed within the window (the registry's writes are idempotent, its answers
travel in the clear anyway); keep the registry on a private network or behind TLS for that.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time

from tiersync.net.errors import AuthError

__all__ = ["METADATA_KEY", "WINDOW_S", "check_proof", "proof"]

METADATA_KEY = "tiersync-auth"
WINDOW_S = 300.0
"""How far a proof's time may be from the server's clock (hosts' clocks differ a little)."""
_TAG = b"tiersync-registry-v1"
_MAX_PROOF = 160  # "v1:" + 13-20 digits + 32 + 64 hex and separators


def _mac(token: bytes, method: str, millis: int, nonce: str, payload: bytes) -> str:
    context = b"\0".join(
        (_TAG, method.encode(), str(millis).encode(), nonce.encode(), hashlib.sha256(payload).digest())
    )
    return hmac.new(token, context, hashlib.sha256).hexdigest()


def proof(token: bytes, method: str, payload: bytes, *, now: float | None = None) -> str:
    """The metadata value proving ``token`` for a call of ``method`` carrying ``payload``."""
    millis = int((time.time() if now is None else now) * 1000)
    nonce = os.urandom(16).hex()
    return f"v1:{millis}:{nonce}:{_mac(token, method, millis, nonce, payload)}"


def check_proof(
    token: bytes, method: str, payload: bytes, value: str | None, *, peer: str, window_s: float = WINDOW_S
) -> None:
    """Raise :class:`AuthError` (naming ``peer``) unless ``value`` proves ``token`` for this call."""
    if value is None:
        raise AuthError("registry call without a token proof", peer=peer)
    parts = value.split(":") if len(value) <= _MAX_PROOF else []
    if len(parts) != 4 or parts[0] != "v1" or not (parts[1].isascii() and parts[1].isdigit()) or len(parts[2]) != 32:
        raise AuthError("malformed registry token proof", peer=peer)
    millis = int(parts[1])
    if abs(time.time() - millis / 1000) > window_s:
        raise AuthError("registry token proof outside the time window (clock skew or a replay)", peer=peer)
    if not hmac.compare_digest(parts[3].encode(), _mac(token, method, millis, parts[2], payload).encode()):
        raise AuthError("registry token proof does not match (wrong token)", peer=peer)
