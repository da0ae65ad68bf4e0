"""tiersync as a vLLM weight-transfer backend: the trainer side (``TrainerWeightTransferEngine``).

What an RL trainer (verl, OpenRLHF, NeMo-RL) writes, with vLLM's own client of the server's
routes (``HTTPVLLMWeightSyncClient``) or of ``LLM`` / Ray actors::

    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from tiersync.integrations.vllm.weight_trainer import TierSyncTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        TierSyncTrainerInitInfo(rank=0, token_file="token.txt"),
        client=HTTPVLLMWeightSyncClient("http://sampler:8000"), source=ModuleSource(model))
    ...                      # a training step
    engine.send_weights()    # the samplers serve the new weights when it returns

``trainer_init`` starts a :class:`~tiersync.weights.WeightPublisher` (rank 0 only) over the
source's tensors and sends the workers its address and token through
``init_weight_transfer_engine``; each ``send_weights`` publishes the next version (the
samplers pull it: shared memory on this host, TCP elsewhere, fanned out as a tree), then drives
``start_weight_update`` / ``update_weights({"version": v})`` / ``finish_weight_update(str(v))``
and resets the engine's prefix cache, so no KV of the old weights is reused. Importing this
module registers the backend ``"tiersync"`` with vLLM's factories (both sides).
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from tiersync.errors import RemoteError, UsageError
from tiersync.integrations.vllm.plugin import register
from tiersync.net.config import token_from

__all__ = ["TierSyncTrainerInitInfo", "TierSyncTrainerWeightTransferEngine"]


@dataclass
class TierSyncTrainerInitInfo(TrainerInitInfo):
    """``listen``: the publisher's "host:port" (port 0 picks one; samplers on other hosts need
    a reachable host). ``token`` / ``token_file``: the shared secret every sampler must prove
    (>= 16 bytes; default ``$TIERSYNC_TOKEN``). ``transport``: what the samplers use, "auto"
    (shared memory on this host, else TCP), "shm" or "tcp". ``samplers``: how many engine
    workers (of every engine together: engines x workers each) must have joined before
    ``trainer_init`` returns. ``timeout_s``: bound of every
    wait (join, one publish)."""

    backend: ClassVar[str] = "tiersync"
    listen: str = "127.0.0.1:0"
    token: str | None = None
    token_file: str | None = None
    transport: str = "auto"
    samplers: int = 1
    timeout_s: float = 300.0


class TierSyncTrainerWeightTransferEngine(TrainerWeightTransferEngine[TierSyncTrainerInitInfo]):
    """Publishes each round as a new version and drives the engine's update (module docstring)."""

    init_info_cls = TierSyncTrainerInitInfo

    def __init__(self, *, client: Any, source: Any, is_sender: bool, info: TierSyncTrainerInitInfo) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info, self.version, self.publisher = info, 0, None
        self.last: Any = None  # the last PublishResult

    @classmethod
    def trainer_init(
        cls, init_info: TierSyncTrainerInitInfo, *, client: Any, source: Any = None
    ) -> TierSyncTrainerWeightTransferEngine:
        if source is None:
            raise UsageError("the tiersync backend publishes a WeightSource; pass source=", argument="source")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, info=init_info)
        if engine.is_sender:
            engine._start()
        return engine

    def _start(self) -> None:
        from tiersync.weights import Mesh, PublisherConfig, Sharding, WeightPublisher

        info = self.info
        token = (
            info.token
            if info.token is not None
            else token_from(info.token_file, argument="TierSyncTrainerInitInfo.token_file")
        )
        tensors = {name: t.detach().cpu() for name, t in self.source}
        self.publisher = WeightPublisher(
            tensors,
            Sharding.replicated(Mesh((1,), ("trainer",))),
            config=PublisherConfig(listen=info.listen, token=token, publish_timeout_s=info.timeout_s),
        )
        try:
            self.client.init_weight_transfer_engine(
                {
                    "publishers": [self.publisher.address],
                    "token": token,
                    "transport": info.transport,
                    "apply_timeout_s": info.timeout_s,
                }
            )
            self.publisher.wait_for_samplers(info.samplers, info.timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def send_weights(self) -> None:
        """Publish the source's current tensors as the next version and make it live."""
        if not self.is_sender:
            for _ in self.source:  # stay in step with the sender's gathers
                pass
            return
        version = self.version + 1
        tensors = {name: t.detach().cpu() for name, t in self.source}
        published = self.publisher.publish(version, tensors)
        self.version = version  # published: the next round is the next version, whatever happens
        self.client.start_weight_update()
        try:
            self.client.update_weights({"version": version})
            self.last = published.result(self.info.timeout_s)
        except BaseException:  # end the engine's update session anyway, or its next start is refused
            with contextlib.suppress(Exception):  # (vLLM may have ended it already: the error is the first one)
                self._finish(version)
            raise
        self._finish(version)
        if not self.last.ok:
            raise RemoteError(
                "a sampler did not receive the version",
                peer="samplers",
                version=version,
                failed=[o.sampler for o in self.last.failed],
            )

    def _finish(self, version: int) -> None:
        self.client.finish_weight_update(str(version))
        _reset_prefix_cache(self.client)

    def shutdown(self) -> None:
        publisher, self.publisher = self.publisher, None
        if publisher is not None:
            publisher.close()


def _reset_prefix_cache(client: Any, attempts: int = 3) -> None:
    """vLLM's prefix cache, and the KV connector's, hold KV of the old weights: reset both
    (running requests recompute) through the client: ``LLM`` has ``reset_prefix_cache``, vLLM's
    Ray client each actor's, the HTTP client the server's route (on with
    ``VLLM_SERVER_DEV_MODE=1``, as the RL routes). vLLM refuses a reset while blocks are held
    (in-flight transfers): tried ``attempts`` times, then RemoteError, since KV of the old
    weights may be served. A client of the four weight routes only has nothing to reset with."""
    for attempt in range(attempts):
        if _reset_once(client):
            return
        time.sleep(0.1 * (attempt + 1))
    raise RemoteError(
        "vLLM refused to reset its prefix cache after the weight update: KV of the old weights may be reused",
        peer="engine",
        attempts=attempts,
    )


def _reset_once(client: Any) -> bool:
    """One reset through ``client`` (see :func:`_reset_prefix_cache`); whether vLLM did it."""
    handles = getattr(client, "handles", None)
    if handles is not None:  # vLLM's RayVLLMWeightSyncClient: every actor (LLM or AsyncLLM)
        import ray

        return all(ray.get([h.reset_prefix_cache.remote(True, True) for h in handles]))
    reset = getattr(client, "reset_prefix_cache", None)
    if reset is not None:
        return reset(reset_running_requests=True, reset_connector=True) is not False
    base = getattr(client, "base_url", None)
    if base is None:
        return True
    import urllib.request

    request = urllib.request.Request(
        f"{base}/reset_prefix_cache?reset_running_requests=true&reset_external=true", method="POST"
    )
    with urllib.request.urlopen(request, timeout=getattr(client, "timeout", 300)) as answer:
        body = answer.read()
    try:
        return json.loads(body).get("success", True) is not False
    except (ValueError, AttributeError):  # an older server answers no JSON object: it reset
        return True


register()
