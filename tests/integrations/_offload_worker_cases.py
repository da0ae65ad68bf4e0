"""Run under the vLLM venv's python (the worker's metadata types import vLLM): a ``kv_both``
worker (:class:`~tiersync.integrations.vllm.worker.OffloadWorker`) whose load before the forward
fails while the same steps save the request's new blocks, and one whose weights changed before a
step planned under the old ones saves. Prints one JSON object."""

from __future__ import annotations

import json
import tempfile
import threading
import time
from concurrent.futures import Future

import torch

from tiersync.integrations.vllm.metadata import LoadJob, SaveJob
from tiersync.integrations.vllm.worker import OffloadWorker
from tiersync.store.keys import CacheIdentity
from tiersync.store.offload import LoadSpec, StoreSpec


def _key(i: int) -> bytes:
    return bytes([i]) * 16


def _save(req: str, key: int, slot: int, block: int) -> SaveJob:
    return SaveJob(req, StoreSpec((_key(key),), (slot,), False), (block,))


def _step(worker: OffloadWorker, saves: list[SaveJob], generation: int = 0) -> dict:
    """One step's saves, then what the worker reports and which key each slot holds."""
    worker.run_saves(saves, generation)
    report = worker.take_report()
    bad = sorted(k[0] for k in report.bad_slots) if report is not None else []
    slots = [None if k is None else k[0] for k in worker._slot_key]  # the worker's record of each slot
    return {"bad": bad, "slots": slots, "load_errors": sorted(worker.take_load_errors())}


def _late_read(out: dict) -> None:
    """A disk read outlives the load's timeout (a stalled mount) and writes into its slot later:
    no save nor read uses that slot until it ended."""
    with tempfile.TemporaryDirectory() as tmp:
        identity = CacheIdentity("m", "w0", "float32", 16)
        worker = OffloadWorker(
            identity=identity, num_slots=4, rank=0, storage_dir=tmp, transfer_workers=1, timeout_s=0.5
        )
        worker.register({"l0": torch.arange(8 * 64, dtype=torch.float32).reshape(8, 64)}, 8)
        worker.run_saves([SaveJob("w", StoreSpec((_key(1),), (0,), True), (0,))])
        while not (worker._report.stored_ok or worker._report.stored_failed):  # the disk write ends
            time.sleep(0.01)
        worker.take_report()
        real, gate, reads = worker._storage.read, threading.Event(), []

        def stalled(keys, bufs):  # the read runs once the mount recovers (the gate opens)
            done: Future = Future()
            threading.Thread(target=lambda: (gate.wait(30), done.set_result(real(keys, bufs).result(30)))).start()
            reads.append(done)
            return done

        worker._storage.read = stalled
        worker.start_loads([LoadJob("r", LoadSpec((_key(1),), (1,), (True,)), (1,))])  # times out after 0.5 s
        out["late_load"] = _step(worker, [_save("s", 2, 1, 2)])  # into the slot the read still writes
        worker.start_loads([LoadJob("t", LoadSpec((_key(1),), (1,), (True,)), (3,))])  # reading there again
        out["late_again"] = _step(worker, [])
        gate.set()
        for read in reads:
            read.result(30)
        worker._storage.read = real
        out["after_late"] = _step(worker, [_save("s", 3, 1, 2)])
        worker.close()


def main() -> dict:
    identity = CacheIdentity("m", "w0", "float32", 16)
    worker = OffloadWorker(identity=identity, num_slots=6, rank=0, storage_dir=None, transfer_workers=1, timeout_s=10.0)
    worker.register({"l0": torch.arange(8 * 64, dtype=torch.float32).reshape(8, 64)}, 8)
    out = {"saved": _step(worker, [_save("r1", 1, 0, 0)])}
    # r2 loads key 1 (slot 0: good) and key 9 (slot 1: never written: bad) before the forward,
    # and the same step saves r2's new block and r3's
    spec = LoadSpec((_key(1), _key(9)), (0, 1), (False, False))
    worker.start_loads([LoadJob("r2", spec, (1, 2))])
    out["failed_step"] = _step(worker, [_save("r2", 5, 2, 3), _save("r3", 6, 3, 4)])
    out["next_step"] = _step(worker, [_save("r2", 7, 2, 5)])  # planned before the error was known
    out["after"] = _step(worker, [_save("r2", 8, 2, 5)])
    worker.weights_updated()
    out["old_weights"] = _step(worker, [_save("r4", 10, 4, 6)], generation=0)
    out["new_weights"] = _step(worker, [_save("r4", 11, 4, 6)], generation=1)
    worker.close()
    _late_read(out)
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
