"""KV events for routers: the host and disk tiers' stores and removals as vLLM ``KVCacheEvent``s.

KV-aware routers (llm-d's kv-indexer, Dynamo's router) subscribe to the events vLLM
publishes with ``--kv-events-config``; vLLM itself announces only its device blocks
(medium ``GPU``). The connector's scheduler half hands its tier changes
(:class:`~tiersync.store.offload.TierChange`) to :class:`KVEventLog`, which turns them into
``BlockStored`` / ``BlockRemoved`` with ``medium`` ``CPU`` (host tier) or ``STORAGE`` (disk
tier), shaped as vLLM's own device events: the engine's block hashes (``request.block_hashes``,
converted as vLLM converts them), the parent block's hash, the block's token ids, block size
and LoRA. vLLM's scheduler publishes them through ``take_events()`` with its own events, in
one ``KVEventBatch`` per step, so a router sees one stream per engine.

What a router sees, per key and tier: one ``BlockStored`` when the copy appears (a save, a
disk write acknowledged by the worker, a disk hit promoted to host), one ``BlockRemoved``
when it goes (evicted, found corrupt or missing). Blocks found on disk when the engine
starts carry no token ids yet: they are announced the first time a request hits them.
Consecutive blocks of one request and tier travel in one event, as vLLM's own do.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tiersync.store.offload import TierChange
from tiersync.store.residency import Residency

__all__ = ["KVEventLog"]


@dataclass(frozen=True, slots=True)
class _Block:
    """What a BlockStored says about one block, captured while its request is alive."""

    block_hash: Any  # vLLM's ExternalBlockHash (bytes, or int with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
    parent_hash: Any
    token_ids: tuple[int, ...]
    lora_id: int | None
    lora_name: str | None


class KVEventLog:
    """Block facts learned from requests + tier changes -> vLLM KV events (see module doc)."""

    def __init__(self, block_size: int) -> None:
        from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        self.block_size = block_size
        self._medium = {Residency.HOST: MEDIUM_CPU, Residency.STORAGE: MEDIUM_STORAGE}
        self._convert = maybe_convert_block_hash
        self._blocks: dict[bytes, _Block] = {}
        self._announced: dict[bytes, set[Residency]] = {}  # tiers a BlockStored was sent for
        self._silent: dict[bytes, set[Residency]] = {}  # present, no token ids known yet
        self._late: list[TierChange] = []  # silent copies a request has now described
        self._retired: list[tuple[Residency, Any]] = []  # (tier, block hash) of a retired namespace

    def learn(self, request: Any, blocks: Iterable[tuple[int, bytes]]) -> None:
        """``blocks`` are (index in the prompt, key) of the request's blocks: remember what a
        BlockStored needs for each (the block hashes vLLM computed for the request)."""
        hashes = getattr(request, "block_hashes", None) or ()
        tokens = request.prompt_token_ids or ()
        lora = getattr(request, "lora_request", None)
        bs = self.block_size
        for i, key in blocks:
            if key in self._blocks or i >= len(hashes):
                continue  # known, or vLLM has not hashed this block (it cannot be announced)
            parent = self._convert(hashes[i - 1]) if i > 0 else None
            self._blocks[key] = _Block(
                self._convert(hashes[i]),
                parent,
                tuple(tokens[i * bs : (i + 1) * bs]),
                getattr(lora, "adapter_id", None),
                getattr(lora, "name", None),
            )
            for tier in self._silent.pop(key, ()):
                self._late.append(TierChange(key, tier, True))

    def retire_all(self) -> None:
        """The scheduler moved to a new key namespace: every block announced so far is gone for
        routers (its keys are never hit again), even while its bytes age out of the tiers; the
        next :meth:`events` says so, and later changes of the old keys are not announced."""
        for key, tiers in self._announced.items():
            self._retired += [(tier, self._blocks[key].block_hash) for tier in tiers]
        self._blocks.clear()
        self._announced.clear()
        self._silent.clear()
        self._late.clear()

    def events(self, changes: Sequence[TierChange]) -> list[Any]:
        """The events for ``changes`` (and for silent copies described since the last call)."""
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        out: list[Any] = [
            BlockRemoved(
                block_hashes=[h for t, h in self._retired if t is tier], medium=self._medium[tier], group_idx=0
            )
            for tier in self._medium
            if any(t is tier for t, _ in self._retired)
        ]
        self._retired = []
        run: list[tuple[TierChange, _Block | None]] = []
        for change in [*self._late, *changes]:
            block = self._apply(change)
            if block is None:
                continue
            if run and not _joins(run[-1], change, block):
                out.append(self._event(run, BlockStored, BlockRemoved))
                run = []
            run.append((change, block))
        if run:
            out.append(self._event(run, BlockStored, BlockRemoved))
        self._late = []
        return out

    def _apply(self, change: TierChange) -> _Block | None:
        """Update what was announced; the block to announce (stored) or whose announced copy
        goes (removed); None when routers need not hear of it."""
        key, tier = change.key, change.tier
        block = self._blocks.get(key)
        if change.stored:
            if block is None:
                self._silent.setdefault(key, set()).add(tier)
                return None
            announced = self._announced.setdefault(key, set())
            if tier in announced:
                return None
            announced.add(tier)
            return block
        silent = self._silent.get(key)
        if silent is not None:
            silent.discard(tier)
            if not silent:
                del self._silent[key]
        announced = self._announced.get(key)
        if announced is None or tier not in announced:
            return None
        announced.discard(tier)
        if not announced:  # no copy left that a router knows of: forget the block
            del self._announced[key]
            self._blocks.pop(key, None)
        return block

    def _event(self, run: list[tuple[TierChange, _Block | None]], stored: type, removed: type) -> Any:
        change, first = run[0]
        medium = self._medium[change.tier]
        if not change.stored:
            return removed(block_hashes=[b.block_hash for _, b in run], medium=medium, group_idx=0)
        return stored(
            block_hashes=[b.block_hash for _, b in run],
            parent_block_hash=first.parent_hash,
            token_ids=[t for _, b in run for t in b.token_ids],
            block_size=self.block_size,
            lora_id=first.lora_id,
            medium=medium,
            lora_name=first.lora_name,
            group_idx=0,
        )


def _joins(last: tuple[TierChange, _Block | None], change: TierChange, block: _Block | None) -> bool:
    """Whether ``change`` continues the event of ``last``: same tier and direction, and for
    stores the next block of the same chain (vLLM's events carry one parent per event)."""
    prev_change, prev = last
    if prev_change.tier is not change.tier or prev_change.stored != change.stored:
        return False
    if not change.stored:
        return True
    return block.parent_hash == prev.block_hash and block.lora_name == prev.lora_name
