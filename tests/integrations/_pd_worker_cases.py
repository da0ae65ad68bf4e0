"""Run under the vLLM venv's python (the worker's metadata types import vLLM): a prefill
engine's worker serving two prompts over a real socket, one of them dropped by the scheduler
(finished with no decode to come), each read by a real consumer, and a third whose
registration is refused; then a decode engine's worker whose two requests name one prefill
request (n > 1 samples, a router's retry). Prints one JSON object."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import torch

from tiersync.disagg import DisaggConfig, KVConsumer, KVOrder, PagedKVLayout, SourceSpec
from tiersync.errors import UsageError
from tiersync.integrations.vllm.metadata import ReadJob, SendJob
from tiersync.integrations.vllm.pd_worker import PDWorker

TOKEN = b"w" * 32
LAYOUT = PagedKVLayout(
    num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, num_blocks=8, dtype="float16",
    tp_size=1, order=KVOrder.HEAD_MAJOR,
)  # fmt: skip
JOBS = {"keep": (1, 2), "drop": (3, 4)}


def _read(consumer: KVConsumer, address: str, rid: str) -> tuple[str, bool]:
    """The read's final state, and whether its blocks landed equal to the producer's."""
    landing = [np.zeros(LAYOUT.layer_nbytes, np.uint8) for _ in range(LAYOUT.num_layers)]
    source = SourceSpec(LAYOUT, (address,), JOBS[rid], 32)
    state = consumer.start_read(rid, source, (0, 1), landing).wait(20)
    return state.name, landing


def _worker(producer: bool) -> tuple[PDWorker, dict]:
    caches = {f"l{i}": torch.randint(-9, 9, (LAYOUT.layer_nbytes // 2,), dtype=torch.int16) for i in range(2)}
    worker = PDWorker(
        producer=producer, layout=LAYOUT, rank=0, config=DisaggConfig(token=TOKEN), host="127.0.0.1", port=0,
        huge_pages=False,
    )  # fmt: skip
    worker.register(caches)
    return worker, caches


def main() -> dict:
    worker, caches = _worker(True)
    worker.start_sends([SendJob(rid, blocks, 32) for rid, blocks in JOBS.items()])
    worker.start_sends([SendJob("refused", (99, 100), 32)])  # blocks past the pool: not served
    worker.all_layers_done()
    early = sorted(worker.results(set())[0])  # nothing is reported before vLLM finishes it
    worker.drop_sends(["drop"])  # what start_load_kv does with the next step's PDMeta.aborts
    reported: list = []
    with KVConsumer(LAYOUT, 0, DisaggConfig(token=TOKEN)) as consumer:
        states = {}
        for rid in JOBS:
            states[rid], landing = _read(consumer, worker.address, rid)
            if rid == "keep":
                unit = LAYOUT.block_nbytes * 2  # head-major: a block's K and V
                want = [caches[f"l{i}"].numpy().view(np.uint8) for i in range(2)]
                exact = all(
                    (landing[i][:2 * unit] == want[i][unit:3 * unit]).all() for i in range(2)
                )  # fmt: skip
        # vLLM reports all finished, and a request that never had a send
        finished, end = {"keep", "drop", "refused", "plain"}, time.monotonic() + 10
        while time.monotonic() < end and "keep" not in reported:
            reported += sorted(worker.results(finished)[0])
            finished = set()
        for _ in range(3):
            reported += sorted(worker.results(set())[0])
    remembered = sorted(worker._finished)  # nothing left behind once every send ended
    worker.close()
    return {"states": states, "exact": exact, "reported": sorted(reported), "early": early, "left": remembered}


def one_prefill_two_reads() -> dict:
    """Decode requests A and B both name prefill request p-1 while A's read runs: B's read is
    refused (B fails, its own blocks load errors), A's lands and is reported as A."""
    prefill, src = _worker(True)
    decode, dst = _worker(False)
    prefill.start_sends([SendJob("p-1", (1, 2), 32)])
    source = SourceSpec(LAYOUT, (prefill.address,), (1, 2), 32).to_dict()
    decode.start_reads([ReadJob("A", "p-1", source, (0, 1)), ReadJob("B", "p-1", source, (2, 3))])
    prefill.all_layers_done()  # p-1's layers are written only now: A's read is still running
    done, failed, end = set(), set(), time.monotonic() + 20
    while time.monotonic() < end and "A" not in done:
        _, now_done, now_failed = decode.results(set())
        done, failed = done | now_done, failed | now_failed
    unit = LAYOUT.block_nbytes * 2  # head-major: a block's K and V
    exact = all(
        (dst[f"l{i}"].numpy().view(np.uint8)[: 2 * unit] == src[f"l{i}"].numpy().view(np.uint8)[unit : 3 * unit]).all()
        for i in range(2)
    )
    errors = sorted(decode.take_load_errors())
    decode.close()
    prefill.close()
    return {"done": sorted(done), "failed": sorted(failed), "load_errors": errors, "exact": exact}


def _in_memfd(address: int) -> bool:
    """The page at ``address`` is a shared map of one of tiersync's memfds."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            low, high = (int(x, 16) for x in line.split()[0].split("-"))
            if low <= address < high:
                return "/memfd:tiersync" in line and line.split()[1].endswith("s")
    return False


def shares() -> dict:
    """share_kv: a producer's KV tensors (39 MB each, as vLLM allocates them: over malloc's
    largest mmap threshold, 32 MiB, so each is memory of its own and never the heap's) are
    backed by memfds once registered, their bytes kept; closing the worker closes the memfds."""
    big = PagedKVLayout(
        num_layers=2, num_kv_heads=8, head_dim=128, block_size=16, num_blocks=600, dtype="float16",
        tp_size=1, order=KVOrder.HEAD_MAJOR,
    )  # fmt: skip
    out = {}
    for share in (True, False):
        caches = {f"l{i}": torch.randint(-9, 9, (big.layer_nbytes // 2,), dtype=torch.int16) for i in range(2)}
        before = [c.clone() for c in caches.values()]
        worker = PDWorker(
            producer=True, layout=big, rank=0, config=DisaggConfig(token=TOKEN), host="127.0.0.1", port=0,
            share_kv=share,
        )  # fmt: skip
        worker.register(caches)
        address = worker.address
        try:
            worker.register(caches)  # vLLM registers once: a second set is refused, the first kept
            again = "accepted"
        except UsageError as exc:
            again = f"{exc.argument}, same address: {worker.address == address}"
        fds = [r.fd for r in worker._shared]
        memfd = [_in_memfd(c.data_ptr() + c.nbytes // 2) for c in caches.values()]
        kept = all(torch.equal(a, b) for a, b in zip(caches.values(), before))
        worker.close()
        out[str(share)] = {"fds": len(fds), "memfd": memfd, "kept": kept, "closed": [_closed(fd) for fd in fds]}
        out[str(share)]["again"] = again
    return out


def _closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


if __name__ == "__main__":
    print(json.dumps(main() | {"one_prefill_two_reads": one_prefill_two_reads(), "shares": shares()}))
