"""Prefill -> decode, scheduler side: which request is sent or received, with which blocks.

The request flow is vLLM's (as with its NIXL connector): a router sends the prompt to the
prefill engine with ``kv_transfer_params={"do_remote_decode": True}`` and ``max_tokens=1``;
when it finishes, the prefill engine returns ``kv_transfer_params={"tiersync_source":
{"request_id", "source", "prompt", "prompt_tokens"}}`` (its request id; KV server
addresses, layout and block ids; a digest of the prompt's token ids and of its cache salt,
LoRA adapter and multimodal inputs; the prompt's token count) and
serves the KV of every prompt token. Blocks move whole, the last partial one too: vLLM's CPU
attention kernels pack the tokens inside a block their own way (a token's K and V are not at
offsets a layout can name), so only a whole block's bytes mean the same on both sides.

What the decode engine loads depends on the prompt the router sends it:

- the prompt followed by the prefill engine's first token (``tiersync router``, as SGLang
  does): every prompt token. The decode engine computes only that first token's K/V, by a
  one-token forward exactly as a monolithic engine's first decode step does: its greedy
  tokens and logprobs are bit for bit a monolithic engine's.
- the same prompt (vLLM's own proxies, as with its NIXL connector): all but the last token,
  which vLLM always computes itself (a request needs one computed token to sample from). That
  token's K/V come from a one-token forward, not the prefill's batched one, so logprobs may
  differ from a monolithic engine's in their last bits (about 1e-6 here), as they do after a
  chunked prefill.
- a prompt that does not start with the prefill's prompt, or another cache salt, LoRA
  adapter or multimodal input (the digest differs), or a prefill engine with another block
  size (its blocks would be regrouped token by token): nothing.

A failed pull is reported as load errors, so the decode engine recomputes. The prefill engine
keeps a prompt's blocks for a decode engine only when the prompt stopped at its token budget;
one that ended otherwise (EOS or a stop string first, aborted) frees them (:meth:`finished`).
A decode engine that will not read a prompt it was offered (it computes it, as above, or the
request ended before its read began: aborted while it waited) tells the prefill engine's
ranks at once (``dropper``: :class:`~tiersync.disagg.dropper.KVDropper`), so they free its
blocks then, not after ``load_timeout_s``.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tiersync.disagg.consumer import SourceSpec
from tiersync.disagg.dropper import KVDropper
from tiersync.disagg.geometry import PagedKVLayout
from tiersync.errors import UsageError
from tiersync.integrations.vllm.metadata import PDMeta, ReadJob, SendJob
from tiersync.integrations.vllm.request_inputs import request_extras

__all__ = ["SOURCE_KEY", "PDScheduler", "prompt_digest"]

log = logging.getLogger(__name__)
SOURCE_KEY = "tiersync_source"


def prompt_digest(token_ids: Sequence[int], extras: Sequence[str] = ()) -> str:
    """A digest of a prompt's token ids (BLAKE2b-128 of them as little-endian int64) and of
    what else decides its KV (``extras``: :func:`~tiersync.integrations.vllm.request_inputs.request_extras`)."""
    h = hashlib.blake2b(np.asarray(token_ids, dtype="<i8").tobytes(), digest_size=16)
    for x in extras:
        data = x.encode("utf-8", "surrogatepass")
        h.update(b"\0" + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


@dataclass(slots=True)
class _Req:
    request: Any
    block_ids: list[int] = field(default_factory=list)
    sent: bool = False
    read: ReadJob | None = None
    pending_source: SourceSpec | None = None
    start: int = 0
    remote_id: str = ""
    warned: bool = False
    dropped: bool = False


class PDScheduler:
    """One role: ``producer`` (prefill) or ``consumer`` (decode). ``dropper``: how a consumer
    tells prefill ranks it will not read a request (closed by :meth:`close`)."""

    def __init__(
        self, *, producer: bool, layout: PagedKVLayout, addresses: tuple[str, ...], dropper: KVDropper | None = None
    ) -> None:
        self.producer, self.layout, self.addresses, self.dropper = producer, layout, addresses, dropper
        self.block_size = layout.block_size
        self._reqs: dict[str, _Req] = {}
        self._aborts: list[str] = []  # producer: served, then finished with no decode to come
        self.loaded_blocks = 0

    def _params(self, request: Any) -> dict:
        p = getattr(request, "kv_transfer_params", None)
        return p if isinstance(p, dict) else {}

    # -- hooks ------------------------------------------------------------------------
    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Producer: 0. Consumer: the prompt tokens the prefill engine offers past
        ``num_computed_tokens`` (see the module docstring), loaded asynchronously."""
        r = self._reqs.setdefault(request.request_id, _Req(request))
        if self.producer or r.read is not None or r.sent or r.dropped:
            return 0, False
        offered = self._offered(request)
        if offered is None:
            return 0, False
        raw, source = offered
        usable = self._usable(r, source, raw.get("prompt"), raw.get("prompt_tokens"))
        start = num_computed_tokens // self.block_size * self.block_size
        if usable <= start:  # computed here: the prefill engine need not keep it
            self._dropped(r, raw["request_id"], source)
            return 0, False
        r.pending_source, r.start, r.remote_id = source, start // self.block_size, raw["request_id"]
        return usable - start, True

    def _offered(self, request: Any) -> tuple[dict, SourceSpec] | None:
        """The prefill's description of ``request``'s KV and where it is; None when none is
        offered (or it is malformed: a miss, not a crash)."""
        raw = self._params(request).get(SOURCE_KEY)
        if not isinstance(raw, dict) or not isinstance(raw.get("request_id"), str):
            return None
        try:
            return raw, SourceSpec.from_dict(raw.get("source"))
        except UsageError:
            return None

    def _dropped(self, r: _Req, remote_id: str, source: SourceSpec) -> None:
        """Tell the prefill ranks once that ``r``'s prompt will not be read from them."""
        if self.dropper is not None and not r.dropped:
            try:
                self.dropper.drop(remote_id, tuple(source.addresses))
            except UsageError as exc:  # an id the wire cannot carry: its timeout frees it
                log.warning("request %s: the prefill cannot be told it is not read: %s", r.request.request_id, exc)
        r.dropped = True

    def _usable(self, r: _Req, source: SourceSpec, digest: Any, n: Any) -> int:
        """How many of the source's prompt tokens (``n``) this request can load (module docstring)."""
        request, prompt = r.request, r.request.prompt_token_ids or ()
        if type(n) is not int or not source.num_tokens - self.block_size < n <= source.num_tokens:
            return 0
        if source.layout.block_size != self.block_size:  # tokens regrouped: offsets inside a block
            if not r.warned:  # mean nothing for vLLM's packed CPU blocks
                log.warning("request %s: the prefill engine's block size differs: computed", request.request_id)
            r.warned = True
            return 0
        if len(prompt) < n or digest != prompt_digest(prompt[:n], request_extras(request)):
            if not r.warned:
                log.warning("request %s: its prompt or inputs differ from the prefill's: computed", request.request_id)
            r.warned = True
            return 0
        return min(request.num_tokens - 1, n)  # vLLM computes at least one token

    def after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        r = self._reqs.get(request.request_id)
        if r is None or r.pending_source is None:
            return
        if num_external_tokens <= 0:  # vLLM computes it after all (its own prefix cache covers it)
            self._dropped(r, r.remote_id, r.pending_source)
            r.pending_source = None
            return
        src, first = r.pending_source, r.start
        blocks = -(-(first * self.block_size + num_external_tokens) // self.block_size)  # whole blocks
        part = SourceSpec(src.layout, src.addresses, src.block_ids[first:blocks], (blocks - first) * self.block_size)
        r.read = ReadJob(request.request_id, r.remote_id, part.to_dict(), tuple(block_ids[first:blocks]))
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
        meta.aborts, self._aborts = self._aborts, []
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
        if r.sent or not prompt or not self._params(r.request).get("do_remote_decode") or computed < prompt:
            return
        # the step that ends the prompt: serve all its blocks, whole, as their layers are computed
        blocks = -(-prompt // self.block_size)
        meta.sends.append(SendJob(rid, tuple(r.block_ids[:blocks]), blocks * self.block_size))
        r.sent = True

    def close(self) -> None:
        if self.dropper is not None:
            self.dropper.close()

    def finished(self, request: Any) -> tuple[bool, dict | None]:
        """Producer: keep the blocks until the decode side has read them; return where it reads.
        Consumer: (False, None); a prompt it was offered and never began to read is dropped.

        Only a prompt that stopped at its token budget (``max_tokens``, as a router asks it)
        has a decode to come. One that ended otherwise (EOS or a stop string as its first token:
        the answer is complete; aborted: no one waits) frees its blocks now, as vLLM's own NIXL
        connector does, and the workers stop serving them at the next step, before any forward
        can write to them: otherwise they stay pinned until ``load_timeout_s``."""
        r = self._reqs.pop(request.request_id, None)
        if not self.producer:
            offered = self._offered(request) if r is None or not (r.sent or r.dropped) else None
            if offered is not None:  # ended before its read was issued: no decode rank will read it
                self._dropped(r or _Req(request), offered[0]["request_id"], offered[1])
            return False, None
        if r is None or not r.sent:
            return False, None
        if getattr(getattr(request, "status", None), "name", None) != "FINISHED_LENGTH_CAPPED":
            self._aborts.append(request.request_id)
            return False, None
        prompt = request.prompt_token_ids or ()
        blocks = -(-len(prompt) // self.block_size)
        source = SourceSpec(self.layout, self.addresses, tuple(r.block_ids[:blocks]), blocks * self.block_size)
        params = {"request_id": request.request_id, "source": source.to_dict()}
        params |= {"prompt": prompt_digest(prompt, request_extras(request)), "prompt_tokens": len(prompt)}
        return True, {SOURCE_KEY: params}
