"""A prefill engine's worker: a prompt the scheduler dropped (finished with no decode to come)
is refused to readers from the next step on and never reported to vLLM as sent, while another
is served byte-exact and reported; one whose registration was refused is reported once vLLM
finished it (else vLLM would hold its blocks for good). The worker's types import vLLM, so the case runs in the
vLLM venv (``_pd_worker_cases.py``) over a real socket and its answers are checked here."""

from __future__ import annotations

import pytest

from _vllm_engine import run_cases

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def answers() -> dict:
    return run_cases("_pd_worker_cases.py")


def test_a_dropped_prompt_is_refused_and_never_reported_sent(answers):
    got = answers
    assert got["states"] == {"keep": "DONE", "drop": "FAILED"}
    assert got["exact"] is True
    assert got["reported"] == ["keep", "refused"]
    assert got["early"] == [] and got["left"] == []


def test_two_decode_requests_naming_one_prefill_request_are_each_reported_as_themselves(answers):
    """The read's bookkeeping was keyed by the prefill's request id: B's refused read took over
    A's entry, A's blocks became load errors while its read still wrote them, and A's end was
    reported under the prefill's id, unknown to vLLM (which then held A's blocks for good)."""
    got = answers["one_prefill_two_reads"]
    assert got["done"] == ["A", "B"] and got["failed"] == ["B"]
    assert got["load_errors"] == [2, 3] and got["exact"] is True


def test_a_producer_shares_its_kv_tensors_and_closes_their_memfds(answers):
    """share_kv (the default): the tensors' memory is a shared map of a tiersync memfd once
    registered, every byte kept; the memfds are closed when the worker closes. share_kv=False
    leaves the tensors private."""
    got = answers["shares"]
    again = "kv_caches, same address: True"  # a second registration is refused, the first kept
    assert got["True"] == {"fds": 2, "memfd": [True, True], "kept": True, "closed": [True] * 2, "again": again}
    assert got["False"] == {"fds": 0, "memfd": [False, False], "kept": True, "closed": [], "again": again}
