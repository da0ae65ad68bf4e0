"""Ray actors of the vLLM part of the Ray weight-sync test.

:class:`VllmSampler`: a rollout worker as verl / OpenRLHF run one, here vLLM's OpenAI server
started by the actor as a subprocess from the vLLM venv (vLLM and Ray live in different
venvs) with tiersync as its weight-transfer backend, and driven over vLLM's RL routes.
:class:`CheckpointTrainer`: the example's trainer actor publishing a checkpoint's tensors
(the parameter names vLLM's loader knows) instead of a toy model.
"""

from __future__ import annotations

import contextlib
import json
import os
import urllib.request

import ray
from ray_workers import TrainerWorker, node_address
from safetensors.torch import load_file

from _vllm_engine import complete, openai_server
from tiersync.weights import Mesh, PublisherConfig, Sharding, WeightPublisher


class CheckpointTrainer(TrainerWorker):
    """A :class:`TrainerWorker` whose weights are ``checkpoint/model.safetensors``."""

    def __init__(self, token: str, checkpoint: str, publish_timeout_s: float) -> None:
        self.state = load_file(os.path.join(checkpoint, "model.safetensors"))
        config = PublisherConfig(listen=node_address(), token=token, publish_timeout_s=publish_timeout_s)
        self.publisher = WeightPublisher(self.state, Sharding.replicated(Mesh((1,), ("trainer",))), config=config)


class VllmSampler:
    """vLLM's OpenAI server (``--weight-transfer-config '{"backend": "tiersync"}'``, RL routes
    on through ``VLLM_SERVER_DEV_MODE=1``) owned by this actor; killed on :meth:`close`."""

    def __init__(self, model: str, log: str) -> None:
        self.model, self._stack = model, contextlib.ExitStack()
        # PYTHONPATH="": the engine imports tiersync from its own venv, nothing from Ray's paths
        self.srv = self._stack.enter_context(
            openai_server(
                model,
                None,
                log,
                "--weight-transfer-config",
                json.dumps({"backend": "tiersync"}),
                env={"VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": ""},
            )
        )

    def _post(self, route: str, body: dict | None = None) -> None:
        request = urllib.request.Request(
            f"{self.srv.url}/{route}",
            data=json.dumps(body or {}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=600) as answer:
            answer.read()

    def join(self, trainer: str, token: str) -> None:
        """Every engine worker starts a receiver of the trainer found by name."""
        address = ray.get(ray.get_actor(trainer).address.remote())
        self._post("init_weight_transfer_engine", {"init_info": {"publishers": [address], "token": token}})

    def update(self, version: int) -> str:
        """Load ``version`` (the workers wait until it landed), reset the prefix cache; the
        engine's weight version afterwards."""
        self._post("start_weight_update")
        self._post("update_weights", {"update_info": {"version": version}})
        self._post("finish_weight_update", {"weight_version": str(version)})
        self._post("reset_prefix_cache?reset_running_requests=true")
        with urllib.request.urlopen(self.srv.url + "/weight_info", timeout=60) as answer:
            return json.loads(answer.read())["weight_version"]

    def complete(self, prompt: list[int]) -> list[int]:
        return complete(self.srv, self.model, prompt)

    def close(self) -> None:
        self._stack.close()
