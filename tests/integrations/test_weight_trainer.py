"""The trainer side of tiersync's vLLM weight-transfer backend resets vLLM's prefix cache after
an update and checks that vLLM did it: vLLM refuses while blocks are held, and an unchecked
refusal left KV of the old weights to be served. The module imports vLLM, so the cases run in
the vLLM venv (``_weight_trainer_cases.py``) and their answers are checked here."""

from __future__ import annotations

import pytest

from _vllm_engine import run_cases

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def answers() -> dict:
    return run_cases("_weight_trainer_cases.py")


def test_a_reset_refused_while_blocks_are_held_is_tried_again(answers):
    assert answers["busy_then_free"] == ["reset", [[True, True], [True, True]]]


def test_a_reset_vllm_keeps_refusing_is_an_error(answers):
    assert answers["always_busy"] == ["raised", 3]


def test_the_server_routes_answer_is_checked(answers):
    assert answers["http_success_true"] == "reset" and answers["http_success_false"] == "raised"
