"""A vLLM worker's side of weight sync, shared by the weight-transfer backend and the extension.

:class:`EngineReceiver` runs one :class:`~tiersync.weights.WeightReceiver` per worker (the
whole model, replicated on every worker: vLLM's ``load_weights`` does its own tensor-parallel
split), waits for a version, and hands its arrays to vLLM as torch tensors with HF names.
:func:`tell_kv_connector` tells the engine's tiersync KV connector that the weights changed.
Importing this module imports neither torch nor vLLM.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from tiersync.errors import RemoteError
from tiersync.weights.config import ReceiverConfig

__all__ = ["EngineReceiver", "tell_kv_connector"]


class EngineReceiver:
    """One worker's receiver (``config``: its :class:`ReceiverConfig`; ``world``: the engine's
    workers). :meth:`wait` then :meth:`named` give what ``load_weights`` takes."""

    def __init__(self, config: ReceiverConfig, world: int) -> None:
        from tiersync.weights import Mesh, Sharding, WeightReceiver

        self._dtypes: dict[int, str] = {}
        destination = Sharding.replicated(Mesh((world,), ("engine",)))
        self.receiver = WeightReceiver(destination, config, allocator=self._allocate)

    def _allocate(self, shape: tuple[int, ...], dtype: str) -> Any:
        """tiersync's allocator, remembering each array's dtype name (raw uint8 arrays, used when
        numpy lacks the dtype, do not carry it)."""
        from tiersync.weights.tensors import allocate

        array = allocate(shape, dtype)
        self._dtypes[array.ctypes.data] = dtype
        return array

    def wait(self, version: int, timeout: float) -> Any:
        """The ReceiveResult once version ``version`` (or a later one) has landed."""
        try:
            return self.receiver.receive(version).result(timeout)
        except FutureTimeout:
            raise RemoteError(
                "the version did not land in time", peer="trainer", version=version, apply_timeout_s=timeout
            ) from None

    def named(self, arrays: Mapping[str, Any]) -> list[tuple[str, Any]]:
        """(HF name, torch tensor viewing the array) for each array of a lease."""
        from tiersync.weights.tensors import as_torch

        with warnings.catch_warnings():  # the lease's arrays are read-only; load_weights only reads them
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return [(name, as_torch(a, self._dtypes.get(a.ctypes.data))) for name, a in arrays.items()]

    def close(self) -> None:
        self.receiver.close()


def tell_kv_connector() -> None:
    """This worker's weights changed (or may have, after a failed load): the engine's KV
    connector, when it is tiersync's offloading one, moves to keys of the new weights
    (``weights_updated``) and never loads KV of the old ones again."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if has_kv_transfer_group():
        weights_updated = getattr(get_kv_transfer_group(), "weights_updated", None)
        if weights_updated is not None:
            weights_updated()
