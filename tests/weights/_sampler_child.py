"""A sampler process for the kill test: ``python _sampler_child.py ADDR RANK COUNT STALL_VERSION``.

Prints ``READY`` once registered; with STALL_VERSION >= 0 it prints ``MIDSYNC`` after the first
chunk of that version landed and then blocks inside the sync (so the test can SIGKILL it
mid-sync). After each version it holds, prints ``VERSION <v> <json digests>``.
"""

from __future__ import annotations

import json
import sys
import threading

from _sync_helpers import digests
from tiersync.weights import Mesh, Sharding
from tiersync.weights.config import ReceiverConfig
from tiersync.weights.receiver import WeightReceiver


def main() -> None:
    address, rank, count, stall = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    blocked = threading.Event()

    def progress(version: int, done: int, total: int) -> None:
        if version == stall and not blocked.is_set():
            blocked.set()
            print("MIDSYNC", done, total, flush=True)
            threading.Event().wait()  # stuck mid-sync until killed

    rec = WeightReceiver(
        Sharding.replicated(Mesh((count,), ("dp",))),
        ReceiverConfig((address,), rank=rank, sampler_id=f"child-{rank}", streams=2),
        progress=progress,
    )
    print("READY", flush=True)
    want = 0
    while True:
        rec.receive(want).result(120)
        with rec.acquire(60) as lease:
            print("VERSION", lease.version, json.dumps(digests(lease.tensors)), flush=True)
            want = lease.version + 1


if __name__ == "__main__":
    main()
