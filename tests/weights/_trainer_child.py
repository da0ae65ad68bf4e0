"""A trainer shard process for the restart tests:
``python _trainer_child.py LISTEN SEED SHM TOKEN RANK COUNT`` (shard RANK of COUNT, FSDP).

Prints ``READY <address>`` once serving. Reads commands on stdin: ``wait N`` (prints
``SAMPLERS`` once N samplers registered) and ``publish V`` (publishes its shard of the model
of seed SEED + V; prints ``PUBLISHED V <ok> <json digests of the whole model>``). Ends at EOF;
the tests SIGKILL it.
"""

from __future__ import annotations

import json
import sys

from _sync_helpers import digests, fsdp, model, shards_of
from tiersync.weights.config import PublisherConfig
from tiersync.weights.publisher import WeightPublisher


def main() -> None:
    listen, seed, shm, token = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "shm", sys.argv[4]
    rank, count = int(sys.argv[5]), int(sys.argv[6])
    config = PublisherConfig(listen=listen, shm=shm, token=token, publish_timeout_s=60, segment_bytes=8 << 10)
    shapes = {n: a.shape for n, a in model(seed).items()}
    pub = WeightPublisher(
        shards_of(model(seed), fsdp(count), rank), fsdp(count), rank=rank, config=config, global_shapes=shapes
    )
    print("READY", pub.address, flush=True)
    for line in sys.stdin:
        cmd, arg = line.split()
        if cmd == "wait":
            pub.wait_for_samplers(int(arg), 60)
            print("SAMPLERS", flush=True)
        elif cmd == "publish":
            g = model(seed + int(arg))
            result = pub.publish(int(arg), shards_of(g, fsdp(count), rank)).result(60)
            print("PUBLISHED", arg, int(result.ok), json.dumps(digests(g)), flush=True)
    pub.close()


if __name__ == "__main__":
    main()
