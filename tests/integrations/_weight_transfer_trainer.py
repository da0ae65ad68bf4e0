"""An RL trainer as verl / OpenRLHF users write one, on vLLM's weight-transfer API (vLLM venv).

``python _weight_transfer_trainer.py URL CHECKPOINT_DIR TOKEN [routes-only | then-stall]``: builds the ``tiersync``
trainer engine through vLLM's ``WeightTransferTrainerFactory`` with vLLM's HTTP client of the
server's routes and a ``WeightSource`` over the checkpoint's tensors, sends them once, and
prints one JSON line: the version sent and the publisher's per-sampler outcomes.
``routes-only``: the client offers the four weight-sync routes and nothing else (no base URL),
so nothing resets the server's caches after the update: only the connector's own reaction to
the new weights keeps old KV out. ``then-stall``: after that version, an update to a version
that is never published (the trainer died, say): the engine must refuse it after its apply
timeout (20 s here) and keep serving the weights it had (``"stalled"``: ``refused`` or ``served``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

from safetensors.torch import load_file
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from tiersync.integrations.vllm.weight_trainer import TierSyncTrainerInitInfo


class CheckpointSource(WeightSource):
    """The trainer's weights: here, a checkpoint's tensors (a trainer passes ModuleSource(model))."""

    def __init__(self, tensors: dict) -> None:
        self.tensors = tensors

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.tensors.items()]

    def __iter__(self):
        return iter(self.tensors.items())


class RoutesOnly:
    """vLLM's weight-sync client protocol, exactly its four methods (a user's own client)."""

    def __init__(self, url: str) -> None:
        self._http = HTTPVLLMWeightSyncClient(url)
        for name in ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update"):
            setattr(self, name, getattr(self._http, name))


def main() -> None:
    url, checkpoint, token = sys.argv[1:4]
    client = RoutesOnly(url) if sys.argv[4:] == ["routes-only"] else HTTPVLLMWeightSyncClient(url)
    source = CheckpointSource(load_file(os.path.join(checkpoint, "model.safetensors")))
    stall = sys.argv[4:] == ["then-stall"]
    info = TierSyncTrainerInitInfo(rank=0, token=token, timeout_s=20.0 if stall else 300.0)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    try:
        engine.send_weights()
        last, stalled = engine.last, None
        if stall:
            client.start_weight_update()
            try:
                client.update_weights({"version": engine.version + 50})
                stalled = "served"
            except Exception:  # noqa: BLE001 - vLLM answers the failed update with an HTTP error
                stalled = "refused"
            with contextlib.suppress(Exception):  # vLLM ended the session with the failure
                client.finish_weight_update()
        print(
            json.dumps(
                {
                    "version": engine.version,
                    "ok": last.ok,
                    "nbytes": last.nbytes,
                    "outcomes": [[o.status.value, o.transport.value] for o in last.outcomes],
                    "stalled": stalled,
                }
            ),
            flush=True,
        )
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
