"""Proof of the shared token on every gRPC registry call (no grpc import here).

A unary call has no session to run the wire stack's challenge on, so each call carries its own
proof in the metadata entry :data:`METADATA_KEY`::

    v1:<unix ms>:<16-byte nonce, hex>:<HMAC-SHA256(token, context), hex>

where the context binds the method, the time, the nonce and the SHA-256 of the request bytes.
The server recomputes it (:func:`check_proof`) and refuses a missing, malformed, forged or
stale proof (older than ``window_s`` by its clock, or dated more than ``future_s`` ahead of
it), and the proof of a call that changes state it already took
(:class:`Replays`: a recorded call replayed within the window, e.g. an old PUBLISH or
UNREGISTER; such a proof is also recorded in the backend where it keeps its
state in Redis, so a restarted registry or a second one on the same Redis refuses it too).
What it does not hide: without TLS the calls travel in the clear.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import logging
import os
import threading
import time

from tiersync.net.errors import AuthError

__all__ = ["FUTURE_S", "METADATA_KEY", "WINDOW_S", "Replays", "check_proof", "proof"]

METADATA_KEY = "tiersync-auth"
WINDOW_S = 300.0
"""How old a proof may be by the server's clock (hosts' clocks differ a little)."""
FUTURE_S = 30.0
"""How far ahead of the server's clock a proof may be dated. Proofs are dropped from a full
:class:`Replays` oldest first and nothing as old is taken afterwards: so a token holder flooding
it with proofs dated ahead keeps honest callers out for at most this long once it stops (it
was the whole window, and a flood had to outpace ``cap`` proofs per this long to go on)."""
log = logging.getLogger(__name__)
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


class Replays:
    """The proofs a server took within the window: each is taken once. At most ``cap`` are
    kept; past that the oldest is dropped and no proof as old as it is taken any more (the
    window shrinks under load instead of letting a dropped proof be replayed; logged once).
    The record is this process's (the gRPC service also records the proofs of calls that
    change state in a Redis backend: :meth:`~tiersync.net.registry.base.Registry.take_once`)."""

    def __init__(self, window_s: float = WINDOW_S, cap: int = 1 << 18) -> None:
        self._window_ms, self._cap = int(window_s * 1000), cap
        self._seen: set[str] = set()
        self._heap: list[tuple[int, str]] = []  # (millis, nonce), the oldest first
        self._floor = -1  # proofs at or before this time are refused
        self._lock = threading.Lock()

    def take(self, millis: int, nonce: str, *, peer: str, now: float | None = None) -> None:
        """Record the proof of ``millis`` and ``nonce`` (one whose MAC checked); AuthError when
        it was taken before or is older than the kept ones."""
        expired = int((time.time() if now is None else now) * 1000) - self._window_ms
        with self._lock:
            while self._heap and self._heap[0][0] < expired:
                self._seen.discard(heapq.heappop(self._heap)[1])
            if nonce in self._seen or millis <= self._floor:
                raise AuthError("registry token proof used before (a replayed call)", peer=peer)
            self._seen.add(nonce)
            heapq.heappush(self._heap, (millis, nonce))
            if len(self._heap) > self._cap:
                oldest, dropped = heapq.heappop(self._heap)
                self._seen.discard(dropped)
                if self._floor < 0:
                    log.warning(
                        "over %d registry calls within the window: older proofs are refused from now", self._cap
                    )
                self._floor = max(self._floor, oldest)


def check_proof(
    token: bytes,
    method: str,
    payload: bytes,
    value: str | None,
    *,
    peer: str,
    window_s: float = WINDOW_S,
    future_s: float = FUTURE_S,
    replays: Replays | None = None,
) -> str:
    """Raise :class:`AuthError` (naming ``peer``) unless ``value`` proves ``token`` for this call
    (and, with ``replays``, was not taken before); the proof's nonce."""
    if value is None:
        raise AuthError("registry call without a token proof", peer=peer)
    parts = value.split(":") if len(value) <= _MAX_PROOF else []
    if len(parts) != 4 or parts[0] != "v1" or not (parts[1].isascii() and parts[1].isdigit()) or len(parts[2]) != 32:
        raise AuthError("malformed registry token proof", peer=peer)
    millis, now = int(parts[1]), time.time()
    if now - millis / 1000 > window_s:
        raise AuthError("registry token proof outside the time window (clock skew or a replay)", peer=peer)
    if millis / 1000 - now > min(future_s, window_s):
        raise AuthError(f"registry token proof dated over {future_s:g} s ahead of this server (clock skew)", peer=peer)
    if not hmac.compare_digest(parts[3].encode(), _mac(token, method, millis, parts[2], payload).encode()):
        raise AuthError("registry token proof does not match (wrong token)", peer=peer)
    if replays is not None:  # only a proof that checked is recorded: junk cannot fill the record
        replays.take(millis, parts[2], peer=peer, now=now)
    return parts[2]
