"""Run under the vLLM venv's python (``pd_scheduler`` imports vLLM): what a decode engine's
scheduler answers ``get_num_new_matched_tokens`` for each case of ``test_pd_scheduler.py``,
and what a prefill engine's does with a served prompt that finished, with vLLM's request and
scheduler output reduced to the fields the hooks read. Prints one JSON object."""

from __future__ import annotations

import json
from types import SimpleNamespace

from vllm.v1.request import RequestStatus

from tiersync.disagg import KVOrder, PagedKVLayout, SourceSpec
from tiersync.integrations.vllm.pd_scheduler import SOURCE_KEY, PDScheduler, prompt_digest

PROMPT = list(range(100, 400))  # 300 tokens: 2 full blocks of 128 and 44 of a third


def _layout(block_size: int = 128) -> PagedKVLayout:
    return PagedKVLayout(
        num_layers=2, num_kv_heads=2, head_dim=8, block_size=block_size, num_blocks=64, dtype="float16",
        tp_size=1, order=KVOrder.HEAD_MAJOR,
    )  # fmt: skip


def _params(prompt: list[int] = PROMPT, block_size: int = 128, extras: tuple = (), **change: object) -> dict:
    blocks = -(-len(prompt) // block_size)
    source = SourceSpec(_layout(block_size), ("127.0.0.1:1",), tuple(range(blocks)), blocks * block_size)
    raw = {"request_id": "p-1", "source": source.to_dict(), "prompt": prompt_digest(prompt, extras)}
    return {SOURCE_KEY: raw | {"prompt_tokens": len(prompt)} | change}


def _source_field(field: str, value: object) -> dict:
    params = _params()
    params[SOURCE_KEY]["source"][field] = value
    return params


def _matched(prompt: list[int], params: dict, computed: int = 0, **inputs: object) -> list:
    """What the decode scheduler loads for a request of ``prompt`` (and ``inputs``: cache_salt,
    lora_request, mm_features) given the prefill's ``params``."""
    request = SimpleNamespace(
        request_id="d-1", prompt_token_ids=prompt, num_tokens=len(prompt), kv_transfer_params=params, **inputs
    )
    return list(PDScheduler(producer=False, layout=_layout(), addresses=()).num_new_matched_tokens(request, computed))


def _finished(status: RequestStatus) -> dict:
    """A prefill engine's scheduler: the step that ends a 300-token prompt, the request finishing
    with ``status``, the next step. What it returned, what each step told the workers."""
    sched = PDScheduler(producer=True, layout=_layout(), addresses=("127.0.0.1:1",))
    request = SimpleNamespace(
        request_id="p-1", prompt_token_ids=PROMPT, num_tokens=len(PROMPT),
        kv_transfer_params={"do_remote_decode": True}, status=RequestStatus.RUNNING,
    )  # fmt: skip
    assert sched.num_new_matched_tokens(request, 0) == (0, False)
    new = SimpleNamespace(req_id="p-1", block_ids=([4, 5, 6],), num_computed_tokens=0)
    step = sched.build_meta(_output([new], {"p-1": len(PROMPT)}))
    request.status = status
    hold, params = sched.finished(request)
    after = sched.build_meta(_output([], {}))
    return {
        "sends": [[j.req_id, list(j.block_ids)] for j in step.sends],
        "hold": hold,
        "params": sorted(params[SOURCE_KEY]) if params else None,
        "aborts": after.aborts,
        "aborts_later": sched.build_meta(_output([], {})).aborts,
    }


def _output(new: list, scheduled: dict) -> SimpleNamespace:
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set())
    return SimpleNamespace(scheduled_new_reqs=new, num_scheduled_tokens=scheduled, scheduled_cached_reqs=cached)


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
    "same_lora": _matched(PROMPT + [7], _params(extras=("ada",)), lora_request=SimpleNamespace(lora_name="ada")),
    "other_lora": _matched(PROMPT + [7], _params(extras=("ada",)), lora_request=SimpleNamespace(lora_name="bob")),
    "lora_only_at_decode": _matched(PROMPT + [7], _params(), lora_request=SimpleNamespace(lora_name="ada")),
    "other_cache_salt": _matched(PROMPT + [7], _params(extras=("salt-1",)), cache_salt="salt-2"),
    "other_image": _matched(
        PROMPT + [7], _params(extras=("img-a",)), mm_features=[SimpleNamespace(identifier="img-b")]
    ),
    "addresses_not_a_list": _matched(PROMPT + [7], _source_field("addresses", 5)),  # was a TypeError
    "block_ids_not_ints": _matched(PROMPT + [7], _source_field("block_ids", ["a", None])),  # ended the engine
    "finished_length_capped": _finished(RequestStatus.FINISHED_LENGTH_CAPPED),
    "finished_stopped": _finished(RequestStatus.FINISHED_STOPPED),
    "finished_aborted": _finished(RequestStatus.FINISHED_ABORTED),
}

if __name__ == "__main__":
    print(json.dumps(CASES))
