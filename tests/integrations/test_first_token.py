"""The router's first-token messages (``integrations/first_token.py``), one test per function:
which requests take the flow, what prefill and decode servers are asked, and how the decode
server's answer (JSON or events) becomes the answer to the client's own prompt."""

from __future__ import annotations

import json

import pytest

from tiersync.integrations import first_token as ft

PROMPT_IDS = [5, 6, 7]
PARAMS = {"tiersync_source": {"request_id": "p-1"}}


def _prefill_answer(finish: str = "length") -> dict:
    choice = {"index": 0, "text": " A", "token_ids": [9], "prompt_token_ids": PROMPT_IDS, "finish_reason": finish}
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    return {"id": "cmpl-p", "object": "text_completion", "created": 1, "model": "m", "choices": [choice]} | {
        "usage": usage,
        "kv_transfer_params": PARAMS,
    }


@pytest.mark.parametrize(
    ("path", "body", "want"),
    [
        ("/v1/completions", {"prompt": "hi"}, 16),
        ("/v1/completions", {"prompt": [1, 2], "max_tokens": 5}, 5),
        ("/v1/completions", {"prompt": "hi", "max_tokens": None, "n": 1}, 16),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1}, 1),
        ("/v1/chat/completions", {"messages": []}, None),
        ("/v1/completions", {"prompt": ["a", "b"]}, None),
        ("/v1/completions", {"prompt": []}, None),
        ("/v1/completions", {"prompt": [1, True]}, None),
        ("/v1/completions", {"prompt": "hi", "n": 2}, None),
        ("/v1/completions", {"prompt": "hi", "echo": True}, None),
        ("/v1/completions", {"prompt": "hi", "logprobs": 1}, None),
        ("/v1/completions", {"prompt": "hi", "suffix": "x"}, None),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, None),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, None),
        ("/v1/completions", {"prompt": "hi", "logprobs": 0}, None),  # 0 still asks for logprobs
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 0}, None),
        ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_object"}}, None),
        ("/v1/completions", {"prompt": "hi", "response_format": {"type": "text"}}, 16),
        ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "a+"}}, None),
        ("/v1/completions", {"prompt": "hi", "bad_words": ["x"]}, None),
        ("/v1/completions", {"prompt": "hi", "frequency_penalty": 0.5}, None),
        ("/v1/completions", {"prompt": "hi", "presence_penalty": 0, "frequency_penalty": 0.0}, 16),
        ("/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": 10}, None),
        ("/v1/completions", {"prompt": "hi", "stream": 1}, None),
        ("/v1/completions", {"prompt": "hi", "return_token_ids": "yes"}, None),
    ],
)
def test_plan_takes_one_prompt_one_choice_completions_only(path, body, want):
    assert ft.plan(path, body) == want


def test_prefill_body_asks_one_token_with_ids_and_caps_min_tokens():
    body = {"prompt": "hi", "max_tokens": 9, "stream": True, "stream_options": {}, "min_tokens": 4}
    ask = ft.prefill_body(body)
    assert ask["max_tokens"] == 1 and ask["stream"] is False and ask["return_token_ids"] is True
    assert ask["kv_transfer_params"] == {"do_remote_decode": True} and ask["min_tokens"] == 1
    assert "stream_options" not in ask and body["max_tokens"] == 9  # the client's body is untouched


def test_first_of_reads_the_token_or_gives_none():
    first = ft.first_of(_prefill_answer())
    assert (first.text, first.token_ids, first.prompt_ids, first.finish_reason) == (" A", [9], PROMPT_IDS, "length")
    for bad in (None, [], {}, {"choices": []}, {"choices": [{"text": "x", "token_ids": [1, 2]}]}):
        assert ft.first_of(bad) is None
    no_prompt = _prefill_answer()
    no_prompt["choices"][0]["prompt_token_ids"] = None
    assert ft.first_of(no_prompt) is None
    for partial in ("", "\ufffd"):  # a byte of a character: the decode server could not finish it
        half = _prefill_answer()
        half["choices"][0]["text"] = partial
        assert ft.first_of(half) is None


def test_decode_body_is_the_prompt_ids_and_the_first_token_for_the_rest():
    first = ft.first_of(_prefill_answer())
    ask = ft.decode_body({"prompt": "hi", "max_tokens": 9, "min_tokens": 3, "stream": True}, first, 9, PARAMS)
    assert ask["prompt"] == PROMPT_IDS + [9] and ask["max_tokens"] == 8 and ask["min_tokens"] == 2
    assert ask["kv_transfer_params"] == PARAMS and ask["return_token_ids"] is True and ask["stream"] is True


@pytest.mark.parametrize("want_ids", [True, False])
def test_merge_puts_the_first_token_in_front_and_counts_it_as_completion(want_ids):
    first = ft.first_of(_prefill_answer())
    decoded = {
        "choices": [{"text": " B C", "token_ids": [10, 11], "prompt_token_ids": PROMPT_IDS + [9]}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
        "kv_transfer_params": None,
    }
    out = ft.merge(first, decoded, want_ids)
    choice = out["choices"][0]
    assert choice["text"] == " A B C" and out["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
    }
    assert choice["token_ids"] == ([9, 10, 11] if want_ids else None)
    assert choice["prompt_token_ids"] == (PROMPT_IDS if want_ids else None) and "kv_transfer_params" not in out
    assert out["id"] == "cmpl-p"
    for hostile in (
        {"choices": []},
        {"choices": ["x"]},
        {"choices": [{"text": 5}]},
        {"choices": [{"token_ids": 3}]},
        [],
    ):
        with pytest.raises(ValueError):
            ft.merge(first, hostile, want_ids)
    odd = {"choices": [{"text": ""}], "usage": {"prompt_tokens": 4, "completion_tokens": "many"}}
    assert ft.merge(first, odd, want_ids)["usage"] == {"prompt_tokens": 3, "completion_tokens": 1}


def test_alone_is_the_prefill_answer_without_its_params():
    first = ft.first_of(_prefill_answer("stop"))
    out = ft.alone(first, want_ids=False)
    assert "kv_transfer_params" not in out and out["choices"][0]["text"] == " A"
    assert out["choices"][0]["token_ids"] is None and first.answer["choices"][0]["token_ids"] == [9]
    events = ft.alone_events(first, want_ids=True, usage=True).split(b"\n\n")
    assert json.loads(events[0][6:])["choices"][0]["finish_reason"] == "stop"
    assert json.loads(events[1][6:])["usage"]["completion_tokens"] == 1 and events[2] == b"data: [DONE]"


def test_stream_fixer_opens_with_the_first_token_then_rewrites_the_decode_events():
    fixer = ft.StreamFixer(ft.first_of(_prefill_answer()), want_ids=True)
    opening = json.loads(fixer.opening()[6:])
    assert opening["id"] == "cmpl-p" and opening["choices"][0]["text"] == " A"
    assert opening["choices"][0]["token_ids"] == [9] and opening["choices"][0]["prompt_token_ids"] == PROMPT_IDS
    ev = {"id": "cmpl-d", "choices": [{"text": " B", "token_ids": [10], "prompt_token_ids": PROMPT_IDS + [9]}]}
    line = json.loads(fixer.line(b"data: " + json.dumps(ev).encode() + b"\n")[6:])
    assert line["id"] == "cmpl-p" and line["choices"][0]["prompt_token_ids"] is None
    assert line["choices"][0]["token_ids"] == [10] and line["choices"][0]["text"] == " B"
    usage = {"id": "cmpl-d", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}}
    assert json.loads(fixer.line(b"data: " + json.dumps(usage).encode())[6:])["usage"]["prompt_tokens"] == 3
    for passthrough in (b"\n", b"data: [DONE]\n", b"data: not json\n", b": comment\n", b'data: {"error": {}}\n'):
        assert fixer.line(passthrough) == passthrough
