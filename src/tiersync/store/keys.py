"""Stable prefix keys for KV blocks.

A block key names the KV of one *full* block of tokens given everything that
came before it. Keys are chained: ``key[i] = xxh3_128(parent, namespace,
token bytes of block i, extra keys)`` where ``parent`` is ``key[i-1]`` (or the
caller's ``parent`` for the first block, or nothing). Hence two requests share
``key[i]`` exactly when they share tokens ``0 .. (i+1)*block_size - 1`` (and the
extra keys), which is what prefix caching needs.

Stability: the hash input is explicit bytes (little-endian int32 token ids, or
int64 when an id does not fit in int32; extra keys encoded with a type tag), so
keys are identical across processes and machines whatever ``PYTHONHASHSEED`` is
— no ``hash()`` anywhere.

Freshness: the :class:`CacheIdentity` namespace digest is folded into every key,
so a new ``weights_version`` (an RL update), another model, KV dtype, block size,
layout or parallel rank gives disjoint keys — stale KV is never served.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from tiersync.errors import UsageError, check_positive_int

KEY_NBYTES = 16
# Element types a KV cache can hold, by the names numpy, torch ("torch." dropped), JAX and
# vLLM's --kv-cache-dtype use; ``kv_dtype`` is one of them or several joined by "/" (the vLLM
# connector writes "<cache dtype>/<model dtype>", e.g. "auto/torch.bfloat16").
KV_DTYPES = frozenset(
    {
        "auto",
        "float16",
        "half",
        "fp16",
        "bfloat16",
        "bf16",
        "float32",
        "float",
        "fp32",
        "float64",
        "double",
        "fp8",
        "fp8_e4m3",
        "fp8_e5m2",
        "fp8_inc",
        "fp8_ds_mla",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "int8",
        "uint8",
        "int4",
        "uint4",
        "nvfp4",
        "mxfp4",
        "int16",
        "int32",
    }
)
_INT32 = (np.iinfo(np.int32).min, np.iinfo(np.int32).max)


@dataclass(frozen=True, slots=True)
class CacheIdentity:
    """Everything that makes two KV blocks of the same tokens interchangeable.

    ``layout_digest`` is ``KVLayout.digest()`` (16 bytes) or empty; ``rank`` is
    the tensor/pipeline-parallel rank whose shard the blocks hold.
    """

    model: str
    weights_version: str
    kv_dtype: str
    block_size: int
    layout_digest: bytes = b""
    rank: int = 0

    def __post_init__(self) -> None:
        for name in ("model", "weights_version", "kv_dtype"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v:
                raise UsageError("must be a non-empty str", argument=f"CacheIdentity.{name}", value=v)
        check_kv_dtype(self.kv_dtype)
        check_positive_int(self.block_size, "CacheIdentity.block_size")
        if not isinstance(self.layout_digest, bytes) or len(self.layout_digest) > 64:
            raise UsageError("must be at most 64 bytes", argument="CacheIdentity.layout_digest")
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
            raise UsageError("must be a non-negative int", argument="CacheIdentity.rank", value=self.rank)

    def digest(self) -> bytes:
        """16-byte namespace digest (xxh3_128 of a length-prefixed encoding of every field)."""
        h = xxhash.xxh3_128()
        h.update(b"tiersync-cache-identity/1")
        for field in (self.model, self.weights_version, self.kv_dtype):
            _update_bytes(h, field.encode("utf-8"))
        h.update(struct.pack("<qq", self.block_size, self.rank))
        _update_bytes(h, self.layout_digest)
        return h.digest()


def check_kv_dtype(kv_dtype: str) -> None:
    """UsageError unless every "/"-separated part of ``kv_dtype`` names a KV element type."""
    unknown = [p for p in kv_dtype.split("/") if p.removeprefix("torch.").removeprefix("jnp.") not in KV_DTYPES]
    if unknown:
        raise UsageError(
            f"names no KV dtype ({unknown[0]!r}); use one of {sorted(KV_DTYPES)}, or several joined by '/'",
            argument="CacheIdentity.kv_dtype",
            value=kv_dtype,
        )


def block_keys(
    token_ids: Sequence[int] | np.ndarray,
    identity: CacheIdentity,
    extra_keys: Iterable[object] = (),
    parent: bytes | None = None,
) -> list[bytes]:
    """One 16-byte key per *full* block of ``token_ids`` (a trailing partial block gets none).

    ``extra_keys`` (e.g. a LoRA id, multimodal content hashes) are mixed into
    every block's key; items must be ``str``, ``bytes`` or ``int``. ``parent``
    continues a chain (the key of the block before ``token_ids[0]``).
    """
    if not isinstance(identity, CacheIdentity):
        raise UsageError("must be a CacheIdentity", argument="identity", got=type(identity).__name__)
    if parent is not None and (not isinstance(parent, bytes) or len(parent) != KEY_NBYTES):
        raise UsageError(f"must be {KEY_NBYTES} bytes or None", argument="parent")
    tokens = _as_token_array(token_ids)
    salt = identity.digest() + _encode_extras(extra_keys)
    bs = identity.block_size
    width = b"\x04" if tokens.dtype == np.int32 else b"\x08"
    keys: list[bytes] = []
    prev = parent if parent is not None else b""
    raw = tokens.tobytes()
    step = bs * tokens.itemsize
    for i in range(len(tokens) // bs):
        h = xxhash.xxh3_128()
        h.update(len(prev).to_bytes(1, "little") + prev)
        h.update(salt + width)
        h.update(raw[i * step : (i + 1) * step])
        prev = h.digest()
        keys.append(prev)
    return keys


def _as_token_array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    try:
        arr = np.asarray(token_ids)
    except (TypeError, ValueError) as exc:
        raise UsageError("must be a sequence of ints", argument="token_ids") from exc
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise UsageError("must be a 1-D sequence of ints", argument="token_ids", dtype=str(arr.dtype))
    if arr.size == 0:
        return arr.astype("<i4")
    lo, hi = int(arr.min()), int(arr.max())
    if _INT32[0] <= lo and hi <= _INT32[1]:
        return arr.astype("<i4")
    if hi > np.iinfo(np.int64).max:
        raise UsageError("token id does not fit in int64", argument="token_ids", value=hi)
    return arr.astype("<i8")


def _encode_extras(extra_keys: Iterable[object]) -> bytes:
    if isinstance(extra_keys, (str, bytes)):
        raise UsageError("must be an iterable of keys, not a single str/bytes", argument="extra_keys")
    out = bytearray()
    for i, k in enumerate(extra_keys):
        if isinstance(k, bytes):
            tag, data = b"b", k
        elif isinstance(k, str):
            tag, data = b"s", k.encode("utf-8")
        elif isinstance(k, int) and not isinstance(k, bool):
            tag, data = b"i", k.to_bytes(16, "little", signed=True)
        else:
            raise UsageError("items must be str, bytes or int", argument=f"extra_keys[{i}]", got=type(k).__name__)
        out += tag + struct.pack("<I", len(data)) + data
    return bytes(out)


def _update_bytes(h: xxhash.xxh3_128, data: bytes) -> None:
    h.update(struct.pack("<I", len(data)) + data)


def check_keys(keys: Sequence[bytes], *, nbytes: int | None = None) -> list[bytes]:
    """The keys as a list; UsageError naming ``keys`` (and the index) unless ``keys`` is a
    sequence (not one bytes/str) of bytes keys of 1..32 bytes, or exactly ``nbytes``."""
    if isinstance(keys, (bytes, str)) or not isinstance(keys, Sequence):
        raise UsageError("must be a sequence of keys, not one key", argument="keys", got=type(keys).__name__)
    out = list(keys)
    for i, k in enumerate(out):
        ok = isinstance(k, bytes) and (len(k) == nbytes if nbytes is not None else 0 < len(k) <= 32)
        if not ok:
            want = f"{nbytes} bytes" if nbytes is not None else "1..32 bytes"
            raise UsageError(f"keys must be {want}", argument=f"keys[{i}]", key=k)
    return out
