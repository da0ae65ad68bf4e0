"""Run under the vLLM venv's python (``pd_scheduler`` imports vLLM): what a decode engine's
scheduler answers ``get_num_new_matched_tokens`` for each case of ``test_pd_scheduler.py``,
with vLLM's request reduced to the fields the hook reads. Prints one JSON object."""

from __future__ import annotations

import json
from types import SimpleNamespace

from tiersync.disagg import KVOrder, PagedKVLayout, SourceSpec
from tiersync.integrations.vllm.pd_scheduler import SOURCE_KEY, PDScheduler, prompt_digest

PROMPT = list(range(100, 400))  # 300 tokens: 2 full blocks of 128 and 44 of a third


def _layout(block_size: int = 128) -> PagedKVLayout:
    return PagedKVLayout(
        num_layers=2, num_kv_heads=2, head_dim=8, block_size=block_size, num_blocks=64, dtype="float16",
        tp_size=1, order=KVOrder.HEAD_MAJOR,
    )  # fmt: skip


def _params(prompt: list[int] = PROMPT, block_size: int = 128, **change: object) -> dict:
    blocks = -(-len(prompt) // block_size)
    source = SourceSpec(_layout(block_size), ("127.0.0.1:1",), tuple(range(blocks)), blocks * block_size)
    raw = {"request_id": "p-1", "source": source.to_dict(), "prompt": prompt_digest(prompt)}
    return {SOURCE_KEY: raw | {"prompt_tokens": len(prompt)} | change}


def _matched(prompt: list[int], params: dict, computed: int = 0) -> list:
    request = SimpleNamespace(
        request_id="d-1", prompt_token_ids=prompt, num_tokens=len(prompt), kv_transfer_params=params
    )
    return list(PDScheduler(producer=False, layout=_layout(), addresses=()).num_new_matched_tokens(request, computed))


CASES = {
    "prompt_and_first_token": _matched(PROMPT + [7], _params()),
    "same_prompt": _matched(PROMPT, _params()),
    "local_prefix_hit": _matched(PROMPT + [7], _params(), computed=128),
    "other_prompt": _matched([1] + PROMPT[1:] + [7], _params()),
    "shorter_prompt": _matched(PROMPT[:200], _params()),
    "other_block_size": _matched(PROMPT + [7], _params(block_size=64)),
    "count_not_int": _matched(PROMPT + [7], _params(prompt_tokens=299.0)),
    "count_past_blocks": _matched(PROMPT + [7], _params(prompt_tokens=500)),
    "count_short_of_blocks": _matched(PROMPT + [7], _params(prompt_tokens=100)),
    "malformed_source": _matched(PROMPT + [7], {SOURCE_KEY: {"request_id": "p-1", "source": {"layout": 1}}}),
}

if __name__ == "__main__":
    print(json.dumps(CASES))
