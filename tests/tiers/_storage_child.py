"""Child process of the storage crash / sharing tests.

``write DIR RUN``: write batches forever, printing ``ACK <hex> <hex>...`` after each
acknowledged (durable) write. ``serve DIR``: for each stdin line of hex keys, look the keys
up in the shared directory (refresh on miss) and print ``OK``/``BAD``/``MISS`` per key.
``delete DIR``: write 8 blocks as one segment, delete every other one, print
``DELETED <hex>...`` then wait (to be SIGKILLed) without closing the tier.
"""

from __future__ import annotations

import itertools
import mmap
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _storage_helpers import IDENT, block_bytes, key
from tiersync.tiers.storage import ReadStatus, StorageConfig, StorageTier

NB = 8192


def _aligned_copy(data: bytes) -> mmap.mmap:
    buf = mmap.mmap(-1, len(data))  # page aligned: eligible for O_DIRECT
    buf[:] = data
    return buf


def write_forever(directory: str, run: str, fixed: int | None = None) -> None:
    tier = StorageTier(StorageConfig(directory, IDENT, workers=2))
    print("READY", flush=True)
    for i in itertools.count():
        keys = [key(i * 8 + j, run) for j in range(1 + i % 4)]
        nb = fixed or NB * (1 + i % 3)
        bufs = [bytearray(block_bytes(k, nb)) if i % 2 else _aligned_copy(block_bytes(k, nb)) for k in keys]
        tier.write(keys, [memoryview(b) for b in bufs]).result()  # odd: buffered, even: O_DIRECT writes
        print("ACK " + " ".join(f"{k.hex()}:{nb}" for k in keys), flush=True)


def serve(directory: str) -> None:
    tier = StorageTier(StorageConfig(directory, IDENT, workers=2))
    print("READY", flush=True)
    for line in sys.stdin:
        out = []
        for item in line.split():
            k, nb = bytes.fromhex(item.split(":")[0]), int(item.split(":")[1])
            if not tier.contains(k):
                tier.refresh()
            buf = bytearray(nb)
            st = tier.read([k], [memoryview(buf)]).result()[0]
            out.append("MISS" if st is not ReadStatus.OK else ("OK" if bytes(buf) == block_bytes(k, nb) else "BAD"))
        print(" ".join(out), flush=True)


def delete_then_wait(directory: str) -> None:
    tier = StorageTier(StorageConfig(directory, IDENT, workers=2))
    keys = [key(i, "del") for i in range(8)]
    bufs = [np.frombuffer(bytearray(block_bytes(k, NB)), dtype=np.uint8) for k in keys]
    tier.write(keys, [memoryview(b) for b in bufs]).result()
    tier.delete(keys[::2])
    print("DELETED " + " ".join(k.hex() for k in keys[::2]), flush=True)
    sys.stdin.read()  # killed here, the tier never closed


if __name__ == "__main__":
    if sys.argv[1] == "delete":
        delete_then_wait(sys.argv[2])
    elif sys.argv[1] == "write":
        write_forever(sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else None)
    else:
        serve(sys.argv[2])
