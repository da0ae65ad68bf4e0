"""A sampler process for the delta tests: ``python _delta_child.py ADDR RANK COUNT TRANSPORT BUFFERS``.

Prints ``READY`` once registered; after each version it holds
``VERSION <v> <moved> <copied> <nbytes> <json digests>``, and ``FAILED <v>`` for a version it
could not sync. Commands on stdin (each acknowledged on stdout, so the test waits for it):
``STALL <v>`` (every progress call of version v blocks until ``GO``: the sync of v stalls after
its first fetched chunks) -> ``ARMED``; ``GO`` -> ``GONE``; ``DAMAGE <nbytes> <offset>`` flips
the byte at ``offset`` of every weight array of ``nbytes`` bytes this sampler allocated (through
the receiver's ``allocator`` argument: engine-owned memory the engine could scribble on) ->
``DAMAGED``.
"""

from __future__ import annotations

import json
import sys
import threading

import numpy as np

from _sync_helpers import digests
from tiersync.errors import TierSyncError
from tiersync.weights import Mesh, Sharding
from tiersync.weights.config import ReceiverConfig, TransportKind
from tiersync.weights.receiver import WeightReceiver
from tiersync.weights.tensors import allocate


def main() -> None:
    address, rank, count, transport, buffers = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
        int(sys.argv[5]),
    )
    arrays: list[np.ndarray] = []
    stall, go = [-1], threading.Event()

    def alloc(shape: tuple, dtype: str) -> np.ndarray:
        arrays.append(allocate(shape, dtype))
        return arrays[-1]

    def progress(version: int, done: int, total: int) -> None:
        if version == stall[0]:
            go.wait()

    def commands() -> None:
        for line in sys.stdin:
            words = line.split()
            if words[0] == "STALL":
                stall[0] = int(words[1])
                go.clear()
                print("ARMED", flush=True)
            elif words[0] == "GO":  # acknowledged first: the stalled sync's FAILED line comes after it
                print("GONE", flush=True)
                go.set()
            elif words[0] == "DAMAGE":
                for a in arrays:
                    if a.nbytes == int(words[1]):
                        a.reshape(-1).view(np.uint8)[int(words[2])] ^= 0xFF
                print("DAMAGED", flush=True)

    cfg = ReceiverConfig(
        (address,),
        rank=rank,
        sampler_id=f"delta-{rank}",
        transport=TransportKind(transport),
        buffers=buffers,
        streams=1,
        window=1,  # one GET at a time: a stalled sync still has GETs to send when it resumes
        copy_threads=1,
    )
    rec = WeightReceiver(Sharding.replicated(Mesh((count,), ("dp",))), cfg, progress=progress, allocator=alloc)
    threading.Thread(target=commands, daemon=True).start()
    print("READY", flush=True)
    want = 0
    while True:
        try:
            res = rec.receive(want).result(120)
        except TierSyncError:
            print("FAILED", want, flush=True)
            want += 1
            continue
        with rec.acquire(60) as lease:
            print(
                "VERSION",
                lease.version,
                res.moved,
                res.copied,
                res.nbytes,
                json.dumps(digests(lease.tensors)),
                flush=True,
            )
            want = lease.version + 1


if __name__ == "__main__":
    main()
