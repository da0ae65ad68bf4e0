"""Prefill -> decode, worker side: serve or pull a request's KV straight from/into vLLM's pool.

On the CPU the engine's KV tensors are host memory, so the producer serves them in place
(each layer as soon as its attention has written it: ``save_kv_layer``) and the consumer
lands arriving layers directly in the destination blocks. Status is polled every step and
reported through ``get_finished``; a failed read's blocks are load errors (recomputed).
The producer backs its tensors by sealed memfds when it registers them (``share_kv``,
:func:`~tiersync.tiers.shareable.share_all`): a decode engine on the same host then maps them
and copies at memory speed, checksummed as ever, instead of through ``process_vm_readv``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tiersync.disagg.config import DisaggConfig
from tiersync.disagg.consumer import KVConsumer, SourceSpec
from tiersync.disagg.geometry import PagedKVLayout
from tiersync.disagg.producer import KVProducer
from tiersync.errors import TierSyncError, UsageError
from tiersync.integrations.vllm.metadata import ReadJob, SendJob
from tiersync.tiers.huge_pages import Collapser
from tiersync.tiers.shareable import SharedRegion, share_all

log = logging.getLogger(__name__)

__all__ = ["PDWorker", "layer_bytes"]

YIELD_S = 0.002


def layer_bytes(tensor: Any, nbytes: int, name: str) -> np.ndarray:
    """A uint8 numpy view of a CPU tensor's whole storage (in place). UsageError when the
    tensor is not a contiguous CPU tensor of ``nbytes`` bytes."""
    if getattr(tensor, "device", None) is not None and str(tensor.device) != "cpu":
        raise UsageError(
            "prefill->decode runs on CPU KV caches in this build",
            argument=f"kv_caches[{name!r}]",
            device=str(tensor.device),
        )
    if not tensor.is_contiguous() or tensor.numel() * tensor.element_size() != nbytes:
        raise UsageError(
            "must be a contiguous tensor of the layout's layer size",
            argument=f"kv_caches[{name!r}]",
            nbytes=tensor.numel() * tensor.element_size(),
            expected=nbytes,
        )
    import torch

    return tensor.view(-1).view(dtype=torch.uint8).numpy()


class PDWorker:
    """The producer's or the consumer's worker half, for one rank."""

    def __init__(
        self,
        *,
        producer: bool,
        layout: PagedKVLayout,
        rank: int,
        config: DisaggConfig,
        host: str,
        port: int,
        huge_pages: bool = True,
        share_kv: bool = True,
    ) -> None:
        self.producer, self.layout, self.rank = producer, layout, rank
        self._config, self._host, self._port, self._huge_pages = config, host, port, huge_pages
        self._share_kv = share_kv
        self._shared: tuple[SharedRegion, ...] = ()  # producer: its KV tensors' memfds
        self._collapser: Collapser | None = None
        self._layers: list[np.ndarray] = []
        self._index: dict[str, int] = {}
        self._server: KVProducer | None = None
        self._client: KVConsumer | None = None
        self._sending: list[str] = []  # registered this step: their layers become ready as computed
        # consumer: the prefill engine's request id -> (ours, our blocks it lands in), per read
        self._reads: dict[str, tuple[str, tuple[int, ...]]] = {}
        self._errors: set[int] = set()
        self._finished: set[str] = set()  # ids vLLM reported finished (sends may only end after)
        self._sent: set[str] = set()
        self._failed_now: set[str] = set()  # consumer: our requests whose read was refused
        self._attempted: set[str] = set()  # producer: sends tried this step
        self._pending: set[str] = set()  # producer: registered, not yet reported by the server
        self._dropped: set[str] = set()  # producer: dropped this step, never reported to vLLM

    def register(self, kv_caches: Mapping[str, Any]) -> None:
        """Serve (producer) or land into (consumer) vLLM's KV tensors, once: a second call is
        refused (UsageError naming ``kv_caches``), the first registration kept."""
        if self._layers:  # vLLM registers once; another set would leave a server on the old one
            raise UsageError("already registered", argument="kv_caches")
        names = list(kv_caches)
        if len(names) != self.layout.num_layers:
            raise UsageError(
                "one KV tensor per layer", argument="kv_caches", layers=len(names), expected=self.layout.num_layers
            )
        self._layers = [layer_bytes(kv_caches[n], self.layout.layer_nbytes, n) for n in names]
        self._index = {n: i for i, n in enumerate(names)}
        if self.producer:
            self._shared = self._share() if self._share_kv else ()
            self._server = KVProducer(
                self.layout, self.rank, self._config, host=self._host, port=self._port, shared=self._shared
            )
        else:
            self._client = KVConsumer(self.layout, self.rank, self._config)
        if self._huge_pages:  # same-host reads of them ran 1.3-1.6x faster (tiers.huge_pages)
            self._collapser = Collapser(self._layers)

    def _share(self) -> tuple[SharedRegion, ...]:
        """Back the KV tensors by memfds (nothing writes them yet: their pages may be remapped)."""
        shared = share_all(self._layers, "kv_caches")
        total = sum(b.nbytes for b in self._layers)
        log.info("KV shared with same-host readers: %.0f of %.0f MB", sum(r.nbytes for r in shared) / 1e6, total / 1e6)
        return shared

    def _unshare(self) -> None:
        """Readers may map the tensors no more (the engine's memory stays)."""
        for region in self._shared:
            os.close(region.fd)
        self._shared = ()

    @property
    def address(self) -> str | None:
        return self._server.address if self._server is not None else None

    # -- producer --------------------------------------------------------------------
    def start_sends(self, jobs: Sequence[SendJob]) -> None:
        """Serve this step's finishing prompts (idempotent within a step: the first call
        registers, later ones do nothing)."""
        for job in jobs:
            if job.req_id in self._attempted:
                continue
            self._attempted.add(job.req_id)
            try:
                self._server.register(job.req_id, job.block_ids, job.num_tokens, self._layers)
            except TierSyncError:
                # not served: the decode side's read fails and it recomputes. A send that ended at
                # once: reported once vLLM finishes the request, or vLLM would hold its blocks forever
                if job.req_id not in self._pending:
                    self._sent.add(job.req_id)
                continue
            self._sending.append(job.req_id)
            self._pending.add(job.req_id)

    def drop_sends(self, req_ids: Sequence[str]) -> None:
        """Stop serving requests vLLM finished without a decode to come (it freed their blocks):
        readers are refused from now on, and the requests are never reported as sent."""
        for rid in req_ids:
            self._dropped.add(rid)
            self._pending.discard(rid)
            self._sent.discard(rid)
            if rid in self._sending:
                self._sending.remove(rid)
            self._server.abort(rid)

    def layer_done(self, layer_name: str) -> None:
        """``layer_name``'s KV of this step is written: push it to the readers."""
        idx = self._index.get(layer_name)
        if idx is not None:
            for rid in self._sending:
                self._server.layer_ready(rid, idx)

    def all_layers_done(self) -> None:
        for rid in self._sending:
            for layer in range(self.layout.num_layers):
                self._server.layer_ready(rid, layer)
        self._sending, self._attempted = [], set()

    # -- consumer --------------------------------------------------------------------
    def start_reads(self, jobs: Sequence[ReadJob]) -> None:
        """Start each job's read; a refused one (e.g. a second request of ours naming a prefill
        request another one is reading: n > 1 samples, a retry) fails that request only, its
        own blocks load errors, and leaves the running read as it was."""
        for job in jobs:
            try:
                source = SourceSpec.from_dict(job.source)
                self._client.start_read(job.remote_id, source, job.dst_block_ids, self._layers)
                self._reads[job.remote_id] = (job.req_id, tuple(job.dst_block_ids))
            except TierSyncError:
                self._errors.update(job.dst_block_ids)
                self._failed_now.add(job.req_id)

    # -- both ------------------------------------------------------------------------
    def results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) since the last call. A
        send is reported only once vLLM has finished the request; a failed read is also a
        finished one, and its blocks are load errors."""
        if self._pending or self._reads:
            # An idle engine steps in a busy loop that starves the transfer threads: block
            # (GIL released) until a transfer finishes, for at most YIELD_S.
            (self._server if self.producer else self._client).wait_progress(YIELD_S)
        if self.producer:
            self._finished |= finished_req_ids
            st = self._server.poll()
            final = set(st.done_sending | st.failed_sending)
            self._pending -= final
            # a dropped request is never reported: this step's poll made it final (abort does at
            # once) unless an earlier one did, and vLLM reports it finished in this step
            self._sent |= final - self._dropped
            self._dropped = set()
            ready = self._sent & self._finished
            self._sent -= ready
            # keep only ids whose send is still going: vLLM reports every finished request (ones
            # never sent too), and a send is registered in a step before its request finishes
            self._finished &= self._pending
            return ready, set(), set()
        st = self._client.poll()
        failed, self._failed_now = self._failed_now, set()
        done = set(failed)
        for rid in set(st.failed_receiving) | set(st.done_receiving):
            entry = self._reads.pop(rid, None)
            if entry is None:  # not ours (only this worker starts reads): nothing to report
                continue
            done.add(entry[0])
            if rid in st.failed_receiving:
                self._errors.update(entry[1])
                failed.add(entry[0])
        return set(), done, failed

    def take_load_errors(self) -> set[int]:
        out, self._errors = self._errors, set()
        return out

    def close(self) -> None:
        if self._collapser is not None:
            self._collapser.stop()
        for side in (self._server, self._client):
            if side is not None:
                side.close()
        self._unshare()
