"""What the scheduler sends the workers each step, and what the workers send back.

Both cross a process boundary (pickled by vLLM), so they hold only plain values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from tiersync.store.offload import LoadSpec, StoreSpec

__all__ = ["LoadJob", "PDMeta", "ReadJob", "SaveJob", "SendJob", "StepMeta", "WorkerReport"]


@dataclass(frozen=True, slots=True)
class LoadJob:
    """Load ``spec`` into the engine's ``device_blocks`` (one per key) for ``req_id``;
    ``background``: off the forward's path, finished through ``get_finished`` (vLLM's
    asynchronous load: the request waits, the batch does not)."""

    req_id: str
    spec: LoadSpec
    device_blocks: tuple[int, ...]
    background: bool = False


@dataclass(frozen=True, slots=True)
class SaveJob:
    """Copy the engine's ``device_blocks`` into ``spec``'s slots after this step."""

    req_id: str
    spec: StoreSpec
    device_blocks: tuple[int, ...]


@dataclass
class StepMeta(KVConnectorMetadata):
    """One engine step's work: loads run before the forward (layer by layer), saves after.
    ``generation``: the weights generation the scheduler planned under (a worker whose weights
    changed since refuses the loads: they are KV of the old weights)."""

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    generation: int = 0


@dataclass
class WorkerReport(KVConnectorWorkerMetadata):
    """Keys whose slot (``bad_slots``) or disk copy (``bad_disk``) turned out unusable, and
    disk writes finished since the last report. Union over workers: a key bad or
    failed on any rank is bad (a disk copy missing on one rank is then read as a miss).
    ``generation``: the worker's weights generation, when it changed (0: unchanged)."""

    bad_slots: set[bytes] = field(default_factory=set)
    bad_disk: set[bytes] = field(default_factory=set)
    stored_ok: set[bytes] = field(default_factory=set)
    stored_failed: set[bytes] = field(default_factory=set)
    generation: int = 0

    def aggregate(self, other: KVConnectorWorkerMetadata) -> WorkerReport:
        if not isinstance(other, WorkerReport):
            return self
        failed = self.stored_failed | other.stored_failed
        return WorkerReport(
            self.bad_slots | other.bad_slots,
            self.bad_disk | other.bad_disk,
            (self.stored_ok | other.stored_ok) - failed,
            failed,
            max(self.generation, other.generation),
        )

    def empty(self) -> bool:
        return not (self.bad_slots or self.bad_disk or self.stored_ok or self.stored_failed or self.generation)


@dataclass(frozen=True, slots=True)
class SendJob:
    """Prefill: serve ``block_ids`` (``num_tokens`` tokens) of ``req_id`` as its layers are computed."""

    req_id: str
    block_ids: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True, slots=True)
class ReadJob:
    """Decode: pull ``source`` (the prefill engine's request ``remote_id``) into ``dst_block_ids``
    for the local request ``req_id``."""

    req_id: str
    remote_id: str
    source: dict
    dst_block_ids: tuple[int, ...]


@dataclass
class PDMeta(KVConnectorMetadata):
    """One prefill->decode step: requests to start serving, reads to start, and requests no
    decode engine will read (served since an earlier step; their blocks are vLLM's again)."""

    sends: list[SendJob] = field(default_factory=list)
    reads: list[ReadJob] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
