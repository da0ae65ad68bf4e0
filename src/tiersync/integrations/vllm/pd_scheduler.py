"""Prefill -> decode, scheduler side: which request is sent or received, with which blocks.

The request flow is vLLM's (as with its NIXL connector): a router sends the prompt to the
prefill engine with ``kv_transfer_params={"do_remote_decode": True}`` and ``max_tokens=1``;
when it finishes, the prefill engine returns ``kv_transfer_params={"tiersync_source":
{"request_id", "source"}}`` (its request id, KV server addresses, layout, block ids); the router sends the same prompt to
the decode engine with those params, and the decode engine pulls the KV instead of
computing it. A failed pull is reported as load errors, so the decode engine recomputes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tiersync.disagg.consumer import SourceSpec
from tiersync.disagg.geometry import PagedKVLayout
from tiersync.errors import UsageError
from tiersync.integrations.vllm.metadata import PDMeta, ReadJob, SendJob

__all__ = ["SOURCE_KEY", "PDScheduler"]

SOURCE_KEY = "tiersync_source"


@dataclass(slots=True)
class _Req:
    request: Any
    block_ids: list[int] = field(default_factory=list)
    sent: bool = False
    read: ReadJob | None = None
    pending_source: SourceSpec | None = None
    start: int = 0
    remote_id: str = ""


class PDScheduler:
    """One role: ``producer`` (prefill) or ``consumer`` (decode)."""

    def __init__(self, *, producer: bool, layout: PagedKVLayout, addresses: tuple[str, ...]) -> None:
        self.producer, self.layout, self.addresses = producer, layout, addresses
        self.block_size = layout.block_size
        self._reqs: dict[str, _Req] = {}
        self.loaded_blocks = 0

    def _params(self, request: Any) -> dict:
        p = getattr(request, "kv_transfer_params", None)
        return p if isinstance(p, dict) else {}

    # -- hooks ------------------------------------------------------------------------
    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Producer: 0. Consumer: the full blocks the prefill engine offers past
        ``num_computed_tokens`` (at least one token is left to compute), loaded asynchronously."""
        r = self._reqs.setdefault(request.request_id, _Req(request))
        if self.producer or r.read is not None or r.sent:
            return 0, False
        raw = self._params(request).get(SOURCE_KEY)
        if not isinstance(raw, dict) or not isinstance(raw.get("request_id"), str):
            return 0, False
        try:
            source = SourceSpec.from_dict(raw.get("source"))
        except UsageError:
            return 0, False  # a malformed description is a miss, not a crash
        usable = min((request.num_tokens - 1) // self.block_size, source.num_tokens // self.block_size)
        start = num_computed_tokens // self.block_size
        if usable <= start:
            return 0, False
        r.pending_source, r.start, r.remote_id = source, start, raw["request_id"]
        return (usable - start) * self.block_size, True

    def after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        r = self._reqs.get(request.request_id)
        if r is None or r.pending_source is None or num_external_tokens <= 0:
            return
        n = num_external_tokens // self.block_size
        src = r.pending_source
        part = SourceSpec(src.layout, src.addresses, src.block_ids[r.start : r.start + n], n * self.block_size)
        r.read = ReadJob(request.request_id, r.remote_id, part.to_dict(), tuple(block_ids[r.start : r.start + n]))
        r.pending_source = None

    def build_meta(self, out: Any) -> PDMeta:
        meta = PDMeta()
        if not self.producer:
            for r in self._reqs.values():
                if r.read is not None:
                    meta.reads.append(r.read)
                    self.loaded_blocks += len(r.read.dst_block_ids)
                    r.read, r.sent = None, True  # issued once; a failure is recomputed, not retried
            return meta
        for req in out.scheduled_new_reqs:
            self._step(
                meta,
                req.req_id,
                list(req.block_ids[0]),
                False,
                req.num_computed_tokens + out.num_scheduled_tokens[req.req_id],
            )
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            self._step(
                meta,
                rid,
                list(new[0]) if new is not None else [],
                rid in cached.resumed_req_ids,
                cached.num_computed_tokens[i] + out.num_scheduled_tokens[rid],
            )
        return meta

    def _step(self, meta: PDMeta, rid: str, new_blocks: list[int], replace: bool, computed: int) -> None:
        r = self._reqs.get(rid)
        if r is None:
            return
        r.block_ids = new_blocks if replace else r.block_ids + new_blocks
        prompt = len(r.request.prompt_token_ids or ())
        if r.sent or not self._params(r.request).get("do_remote_decode") or computed < prompt:
            return
        n = self._offered(prompt)
        if n:  # the step that ends the prompt: serve its full blocks as their layers are computed
            meta.sends.append(SendJob(rid, tuple(r.block_ids[: n // self.block_size]), n))
            r.sent = True

    def _offered(self, prompt_tokens: int) -> int:
        """Tokens a decode engine loads: full blocks, leaving >= 1 prompt token to compute."""
        return (prompt_tokens - 1) // self.block_size * self.block_size

    def finished(self, request: Any) -> tuple[bool, dict | None]:
        """Producer: keep the blocks until the decode side has read them; return where it reads."""
        r = self._reqs.pop(request.request_id, None)
        if not self.producer or r is None or not r.sent:
            return False, None
        n = self._offered(len(request.prompt_token_ids or ()))
        source = SourceSpec(self.layout, self.addresses, tuple(r.block_ids[: n // self.block_size]), n)
        return True, {SOURCE_KEY: {"request_id": request.request_id, "source": source.to_dict()}}
