"""The ``kv_both`` worker (tiersync.integrations.vllm.worker): what it refuses to save. The
worker's types import vLLM, so the case runs in the vLLM venv (``_offload_worker_cases.py``)
and its answers are checked here."""

from __future__ import annotations

import pytest

from _vllm_engine import run_cases

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def answers() -> dict:
    return run_cases("_offload_worker_cases.py")


def test_blocks_computed_on_a_failed_load_are_not_saved(answers):
    """A request's load before the forward fails on one block: the forward computed its new
    blocks attending to a block that never loaded. Those blocks, saved that step (and the next,
    planned before the error was known), were cached under their right keys and served to later
    requests as hits (vLLM recomputes the request, but the scheduler had counted them saved).
    They are refused now, reported bad (misses); another request's save that step is kept."""
    got = answers
    assert got["saved"]["slots"][0] == 1
    failed = got["failed_step"]
    assert failed["load_errors"] == [2] and failed["bad"] == [5, 9]  # 9: the load's bad slot
    assert failed["slots"][2] is None and failed["slots"][3] == 6
    assert got["next_step"]["bad"] == [7] and got["next_step"]["slots"][2] is None
    assert got["after"]["bad"] == [] and got["after"]["slots"][2] == 8


def test_a_step_planned_under_the_old_weights_saves_nothing(answers):
    """The weights changed after the scheduler planned a step: its saves hold KV of the new
    weights under keys of the old ones (on disk, an engine restarted on the old checkpoint would
    load them). They are refused; the next step's, under the new weights, are saved."""
    assert answers["old_weights"]["bad"] == [10] and answers["old_weights"]["slots"][4] is None
    assert answers["new_weights"]["bad"] == [] and answers["new_weights"]["slots"][4] == 11


def test_a_slot_a_late_disk_read_still_writes_is_neither_saved_to_nor_read_into(answers):
    """A disk read outlived the load's timeout (the load failed, the scheduler freed the slot)
    and still wrote into the slot later: a save there, or another read into it, ended with the
    late read's bytes under another key (served as that key's hit, or written to disk under
    it). Until the late read ended the slot is refused (the save's key and the second read's
    are misses); then it is used again."""
    late, again, after = answers["late_load"], answers["late_again"], answers["after_late"]
    assert late["load_errors"] == [1] and late["bad"] == [2] and late["slots"][1] is None
    assert again["load_errors"] == [3] and again["bad"] == [1] and again["slots"][1] is None
    assert after["bad"] == [] and after["slots"][1] == 3
