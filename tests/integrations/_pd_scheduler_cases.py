"""Run under the vLLM venv's python (``pd_scheduler`` imports vLLM): what a decode engine's
scheduler answers ``get_num_new_matched_tokens`` for each case of ``test_pd_scheduler.py``,
and what a prefill engine's does with a served prompt that finished, with vLLM's request and
scheduler output reduced to the fields the hooks read. Prints one JSON object."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import ClassVar

import numpy as np
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


def _drops() -> dict:
    """A decode scheduler with a real KVDropper against a real KVProducer (its timeout 600 s:
    only a drop ends a request in time) offered six prompts: one it computes (another prompt),
    one its prefix cache holds (asked twice), one that ended while it waited (never matched),
    one that ended after its blocks were allocated but before its read was issued, one whose
    read was issued, and one vLLM allocated with no external tokens after all (it computes it). What it asked to drop, which the prefill rank freed, and what
    stayed pending there."""
    from tiersync.disagg import DisaggConfig, KVDropper, KVProducer, RequestState

    class Counting(KVDropper):
        asked: ClassVar[list[str]] = []

        def drop(self, kv_request, addresses):
            self.asked.append(kv_request)
            super().drop(kv_request, addresses)

    layout, token = _layout(), b"d" * 32
    layers = [np.zeros(layout.layer_nbytes, np.uint8) for _ in range(layout.num_layers)]
    producer = KVProducer(layout, 0, DisaggConfig(token=token, timeout_s=600))
    ids = ["p-other", "p-waiting", "p-alloc", "p-read", "p-cached", "p-zero"]
    for i, rid in enumerate(ids):
        producer.register(rid, [3 * i, 3 * i + 1, 3 * i + 2], len(PROMPT), layers)
    sched = PDScheduler(producer=False, layout=layout, addresses=(), dropper=Counting(DisaggConfig(token=token)))

    def request(rid: str, prompt: list[int]) -> SimpleNamespace:
        source = SourceSpec(layout, (producer.address,), (0, 1, 2), 3 * 128)
        raw = {"request_id": rid, "source": source.to_dict(), "prompt": prompt_digest(PROMPT)}
        params = {SOURCE_KEY: raw | {"prompt_tokens": len(PROMPT)}}
        return SimpleNamespace(
            request_id="d" + rid, prompt_token_ids=prompt, num_tokens=len(prompt), kv_transfer_params=params
        )

    other, waiting, alloc, read, cached, zero = (request(rid, PROMPT + [7]) for rid in ids)
    other.prompt_token_ids = [1] + PROMPT[1:] + [7]
    matched = [sched.num_new_matched_tokens(r, 0) for r in (other, alloc, read, zero)]
    matched += [sched.num_new_matched_tokens(cached, 384) for _ in range(2)]  # its own 3 blocks
    sched.after_alloc(alloc, list(range(10)), 300)
    sched.after_alloc(read, list(range(10, 20)), 300)
    sched.after_alloc(zero, list(range(20, 30)), 0)  # vLLM's own cache covers it: computed
    sched.finished(alloc)  # aborted between its allocation and the step that issues reads
    issued = [j.req_id for j in sched.build_meta(_output([], {})).reads]
    for r in (other, waiting, read, cached, zero):
        sched.finished(r)
    flushed = sched.dropper.flush(20)
    failed = producer.poll().failed_sending
    out = {
        "matched": [list(m) for m in matched], "issued": issued, "flushed": flushed, "asked": Counting.asked,
        "confirmed": sched.dropper.confirmed, "freed": sorted(failed),
        "read_pending": producer.state("p-read") is RequestState.PENDING,
    }  # fmt: skip
    sched.close()
    producer.close()
    return out


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
    "drops": _drops(),
}

if __name__ == "__main__":
    print(json.dumps(CASES))
