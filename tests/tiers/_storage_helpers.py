"""Helpers of the storage-tier tests: deterministic block bytes, a tier on a directory, tmpfs mounts."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile

import numpy as np
import xxhash

from tiersync.tiers import storage_format as fmt
from tiersync.tiers.storage import StorageConfig, StorageTier

IDENT = bytes(range(16))


def block_bytes(key: bytes, nbytes: int) -> bytes:
    """The only bytes ``key`` may ever hold: derived from the key itself."""
    seed = xxhash.xxh3_64_intdigest(key)
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def key(i: int, tag: str = "k") -> bytes:
    return xxhash.xxh3_128_digest(f"{tag}-{i}".encode())


def open_tier(path: str, ident: bytes = IDENT, **kw) -> StorageTier:
    return StorageTier(StorageConfig(path, ident, workers=kw.pop("workers", 2), **kw))


def write_keys(tier: StorageTier, keys, nbytes: int) -> None:
    """Write every key's own bytes (:func:`block_bytes`) and wait."""
    bufs = [np.frombuffer(bytearray(block_bytes(k, nbytes)), dtype=np.uint8) for k in keys]
    tier.write(keys, [memoryview(b) for b in bufs]).result(10)


def read_keys(tier: StorageTier, keys, nbytes: int):
    """(statuses, bytes read per key)."""
    outs = [bytearray(nbytes) for _ in keys]
    st = tier.read(keys, [memoryview(o) for o in outs]).result(10)
    return st, [bytes(o) for o in outs]


def segments(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith(fmt.SUFFIX))


@contextlib.contextmanager
def tmpfs(size: str):
    """Mount a private tmpfs of ``size``; yields its path, or None when mounting is not allowed."""
    path = tempfile.mkdtemp(prefix="tiersync-tmpfs-")
    ok = (
        os.geteuid() == 0
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], check=False, capture_output=True
        ).returncode
        == 0
    )
    try:
        yield path if ok else None
    finally:
        if ok:
            subprocess.run(["umount", "-l", path], check=False, capture_output=True)
        os.rmdir(path)


def remount_ro(path: str) -> bool:
    return subprocess.run(["mount", "-o", "remount,ro", path], check=False, capture_output=True).returncode == 0
