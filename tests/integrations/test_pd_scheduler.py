"""What a decode engine's scheduler loads of a prefill engine's KV (``pd_scheduler``'s module
docstring, one case each), and which finished prompts a prefill engine keeps serving. The scheduler imports vLLM, so the cases run in the vLLM venv
(``_pd_scheduler_cases.py``) and their answers are checked here."""

from __future__ import annotations

import pytest

from _vllm_engine import run_cases

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def answers() -> dict:
    return run_cases("_pd_scheduler_cases.py")


def test_prompt_and_the_first_token_loads_every_prompt_token(answers):
    assert answers["prompt_and_first_token"] == [300, True]


def test_the_same_prompt_loads_all_but_the_last_token(answers):
    assert answers["same_prompt"] == [299, True]


def test_the_same_prompt_under_the_same_lora_adapter_loads(answers):
    assert answers["same_lora"] == [300, True]


def test_blocks_in_the_local_prefix_cache_are_not_loaded_again(answers):
    assert answers["local_prefix_hit"] == [172, True]


@pytest.mark.parametrize(
    "case",
    [
        "other_prompt",  # the digest differs
        "shorter_prompt",
        "other_block_size",  # tokens inside vLLM's packed CPU blocks have no offsets to regroup
        "count_not_int",
        "count_past_blocks",
        "count_short_of_blocks",
        "malformed_source",
        "other_lora",  # the prefill's KV was computed under another adapter
        "lora_only_at_decode",
        "other_cache_salt",
        "other_image",
        "addresses_not_a_list",  # any API client sends kv_transfer_params: a miss, not a crash
        "block_ids_not_ints",
    ],
)
def test_anything_else_loads_nothing(answers, case):
    assert answers[case] == [0, False]


def test_a_prompt_stopped_at_its_token_budget_is_kept_for_the_decode_engine(answers):
    got = answers["finished_length_capped"]
    assert got["sends"] == [["p-1", [4, 5, 6]]]
    assert got["hold"] is True and got["params"] == ["prompt", "prompt_tokens", "request_id", "source"]
    assert got["aborts"] == [] and got["aborts_later"] == []


@pytest.mark.parametrize("case", ["finished_stopped", "finished_aborted"])
def test_a_prompt_that_ended_otherwise_frees_its_blocks_and_the_workers_stop_serving(answers, case):
    got = answers[case]
    assert got["sends"] == [["p-1", [4, 5, 6]]]
    assert got["hold"] is False and got["params"] is None
    assert got["aborts"] == ["p-1"] and got["aborts_later"] == []  # told once, in the next step


def test_a_decode_engine_tells_the_prefill_what_it_will_not_read_and_nothing_else(answers):
    """A prompt the decode engine computes itself (another prompt, or its own prefix cache holds
    it), or one that ended before its read was issued, is freed at the prefill rank at once (KV_DROP over a real connection with the token), not
    after ``load_timeout_s``; a prompt whose read was issued stays served."""
    got = answers["drops"]
    assert got["matched"] == [[0, False], [300, True], [300, True], [300, True], [0, False], [0, False]]
    assert got["issued"] == ["dp-read"]
    assert got["asked"] == ["p-other", "p-cached", "p-zero", "p-alloc", "p-waiting"]  # each once, p-zero at once
    assert got["flushed"] is True
    assert got["freed"] == ["p-alloc", "p-cached", "p-other", "p-waiting", "p-zero"] and got["confirmed"] == 5
    assert got["read_pending"] is True
