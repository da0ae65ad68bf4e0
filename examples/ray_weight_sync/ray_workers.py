"""The Ray workers of the RL weight-sync example: one trainer, N samplers (rollout workers).

The shape verl / OpenRLHF / NeMo-RL users know: plain classes made into actors with
``ray.remote(cls).options(...)``; the trainer is a *named* actor, and every sampler looks it
up by name to get the address of the trainer's :class:`~tiersync.weights.WeightPublisher`
(no address is passed around by hand). Each step the driver calls ``trainer.train_step()``,
``trainer.publish(v)`` (returns the publisher's :class:`~tiersync.weights.PublishResult`,
one outcome per sampler) and ``sampler.wait_version(v)`` (a checksum of what it serves).

Samplers form a ``dp x tp`` mesh: sampler ``rank = d * tp + t`` holds rows ``t`` of ``tp``
of every tensor (dimension 0 split over ``tp``, replicated over ``dp``); ``tp=1`` means every
sampler holds the whole model. The trainer holds the whole model (one publisher); samplers
on its host copy each version out of one /dev/shm segment, others GET it over TCP.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import ray
import torch

from tiersync.weights import (
    Mesh,
    PublisherConfig,
    PublishResult,
    ReceiverConfig,
    Sharding,
    WeightPublisher,
    WeightReceiver,
    shard_slices,
)

TRAINER_NAME = "tiersync-weight-trainer"
TIMEOUT_S = 300.0


def sampler_layout(dp: int, tp: int) -> Sharding:
    """The samplers' layout: a dp x tp mesh, dimension 0 of every tensor split over tp."""
    return Sharding(Mesh((dp, tp), ("dp", "tp")), ("tp",))


def digest(tensor: Any) -> tuple[tuple[int, ...], str, str]:
    """(shape, dtype name, sha256 of the bytes in C order) of a torch tensor or numpy array."""
    if isinstance(tensor, torch.Tensor):
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        dtype = str(tensor.dtype).removeprefix("torch.")
    else:
        raw, dtype = np.ascontiguousarray(tensor).reshape(-1).view(np.uint8), tensor.dtype.name
    return tuple(tensor.shape), dtype, hashlib.sha256(raw).hexdigest()


def node_address() -> str:
    """Listen on this node's IP (port 0 picks one): samplers on other nodes must reach it."""
    return f"{ray.util.get_node_ip_address()}:0"


class TrainerWorker:
    """Holds a torch model, trains it a step at a time, publishes its state_dict as versions."""

    def __init__(
        self, token: str, *, hidden: int = 512, layers: int = 4, seed: int = 0, publish_timeout_s: float = TIMEOUT_S
    ) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(*(torch.nn.Linear(hidden, hidden) for _ in range(layers)))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-2)
        # state_dict() tensors share storage with the parameters: publishing re-reads them, so
        # every optimizer step is in the next version without any copy here
        self.state = {name: t.detach() for name, t in self.model.state_dict().items()}
        config = PublisherConfig(listen=node_address(), token=token, publish_timeout_s=publish_timeout_s)
        self.publisher = WeightPublisher(self.state, Sharding.replicated(Mesh((1,), ("trainer",))), config=config)

    def address(self) -> str:
        return self.publisher.address

    def nbytes(self) -> int:
        return self.publisher.nbytes

    def wait_for_samplers(self, count: int, timeout: float = TIMEOUT_S) -> None:
        self.publisher.wait_for_samplers(count, timeout)

    def train_step(self, batch: int = 32) -> float:
        """One SGD step on random data (stands in for the RL update); the loss."""
        x = torch.randn(batch, self.model[0].in_features)
        loss = self.model(x).pow(2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def publish(self, version: int, timeout: float = TIMEOUT_S) -> PublishResult:
        """Send the current weights as ``version``; returns once every sampler answered."""
        return self.publisher.publish(version).result(timeout)

    def expected(self, dp: int, tp: int) -> dict[int, dict[str, tuple]]:
        """Per sampler rank, the digests of the slices it must hold of the current weights."""
        layout = sampler_layout(dp, tp)
        out: dict[int, dict[str, tuple]] = {rank: {} for rank in range(dp * tp)}
        for name, t in self.state.items():
            for rank, index in shard_slices(tuple(t.shape), layout).items():
                out[rank][name] = digest(t[index])
        return out

    def close(self) -> None:
        self.publisher.close()  # unlinks the /dev/shm segment


class SamplerWorker:
    """A rollout worker holding rank ``rank`` of the dp x tp sampler mesh (a plain receiver;
    an inference engine would read ``lease.tensors`` as its weights)."""

    def __init__(
        self, rank: int, dp: int, tp: int, token: str, *, trainer: str = TRAINER_NAME, **receiver_options: Any
    ) -> None:
        address = ray.get(ray.get_actor(trainer).address.remote())  # the trainer, found by name
        self.rank = rank
        self.landed = (None, 0, 0)  # (version, bytes landed, bytes of the version)
        config = ReceiverConfig(
            (address,), rank=rank, token=token, sampler_id=f"sampler-{rank}", listen=node_address(), **receiver_options
        )
        self.receiver = WeightReceiver(sampler_layout(dp, tp), config, progress=self._progress)

    def _progress(self, version: int, done: int, total: int) -> None:
        """Called from the receiver's copy threads after each chunk of a version lands."""
        self.landed = (version, done, total)

    def ready(self) -> int:
        return self.rank

    def wait_version(self, version: int, timeout: float = TIMEOUT_S) -> dict[str, Any]:
        """Block until ``version`` (or a later one) is live; the version held and its digests."""
        self.receiver.receive(version).result(timeout)
        with self.receiver.acquire(timeout) as lease:  # no sync can change it while leased
            return {
                "version": lease.version,
                "tensors": {n: digest(a) for n, a in lease.tensors.items()},
                "transports": [t.value for t in self.receiver.transports()],
            }

    def close(self) -> None:
        self.receiver.close()
