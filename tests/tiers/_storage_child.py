"""Child process of the storage crash / sharing tests.

``write DIR RUN``: write batches forever, printing ``ACK <hex> <hex>...`` after each
acknowledged (durable) write. ``serve DIR``: for each stdin line of hex keys, look the keys
up in the shared directory (refresh on miss) and print ``OK``/``BAD``/``MISS`` per key.
"""
from __future__ import annotations

import itertools
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _storage_helpers import IDENT, block_bytes, key  # noqa: E402
from tiersync.tiers.storage import ReadStatus, StorageConfig, StorageTier  # noqa: E402

NB = 8192


def write_forever(directory: str, run: str, fixed: int | None = None) -> None:
    tier = StorageTier(StorageConfig(directory, IDENT, workers=2))
    print("READY", flush=True)
    for i in itertools.count():
        keys = [key(i * 8 + j, run) for j in range(1 + i % 4)]
        nb = fixed or NB * (1 + i % 3)
        bufs = [np.frombuffer(bytearray(block_bytes(k, nb)), dtype=np.uint8) for k in keys]
        tier.write(keys, [memoryview(b) for b in bufs]).result()
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


if __name__ == "__main__":
    if sys.argv[1] == "write":
        write_forever(sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else None)
    else:
        serve(sys.argv[2])
