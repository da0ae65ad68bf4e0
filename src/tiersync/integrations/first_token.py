"""The router's first-token flow for ``/v1/completions``: the messages, without any I/O.

The prefill server computes the prompt and samples the first token (``max_tokens=1``,
``return_token_ids``); that token is the first of the client's answer. The decode server then
gets the prompt's token ids followed by that token, with the prefill server's
``kv_transfer_params``, and generates the rest: it loads the KV of every prompt token and
computes only the first token's K/V, by a one-token forward as a monolithic engine's first
decode step does. So the greedy tokens are a monolithic engine's, and a streaming client gets
its first token as soon as the prefill server answered.

:func:`plan` says whether a request can take this flow: one prompt, one choice, and nothing
that needs the first token among the output tokens (echo, logprobs, suffix, structured
output, bad words, frequency or presence penalties) or changes the prompt (truncation);
:func:`first_of` reads the prefill answer (None for a first token whose text is not complete
characters, which a decode server would lose when it starts from it); :func:`decode_body` is what
the decode server gets; :func:`merge` and :class:`StreamFixer` make the decode server's
answer (JSON, or server-sent events) the answer for the client's own prompt: the first token's
text and ids in front, usage counting the prompt and the tokens as the client sent and got
them. A stop string that spans the first token and the next is not seen by the decode server.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = [
    "First",
    "StreamFixer",
    "alone",
    "alone_events",
    "decode_body",
    "event",
    "first_of",
    "merge",
    "plan",
    "prefill_body",
]

# keys that must be absent (or None or False) for the flow; 0 counts as present (logprobs=0)
_UNSUPPORTED = (
    "echo",
    "logprobs",
    "suffix",
    "prompt_logprobs",
    "use_beam_search",
    "prompt_embeds",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "truncate_prompt_tokens",
    "logits_processors",
)
_DEFAULT_MAX_TOKENS = 16  # vLLM's default for /v1/completions


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def _absent(value: Any) -> bool:
    return value is None or value is False


def plan(path: str, body: dict[str, Any]) -> int | None:
    """The client's ``max_tokens`` when ``body`` can take the first-token flow, else None."""
    if path != "/v1/completions" or not all(_absent(body.get(k)) for k in _UNSUPPORTED):
        return None
    if body.get("n", 1) not in (None, 1) or body.get("best_of", 1) not in (None, 1) or body.get("bad_words"):
        return None
    if not all(_absent(body.get(k)) or body.get(k) is True for k in ("stream", "return_token_ids")):
        return None  # 1 or "true" would be read differently here and by vLLM
    if body.get("frequency_penalty") not in (None, 0) or body.get("presence_penalty") not in (None, 0):
        return None  # vLLM counts output tokens only: the first would be a prompt token
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if not (isinstance(body.get("prompt"), str) or _is_ids(body.get("prompt"))):
        return None
    max_tokens = body.get("max_tokens", _DEFAULT_MAX_TOKENS)
    max_tokens = _DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    return max_tokens if type(max_tokens) is int and max_tokens >= 1 else None


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill server's request: one token, its id and the prompt's ids returned."""
    ask = {**body, "max_tokens": 1, "stream": False, "return_token_ids": True}
    ask["kv_transfer_params"] = {"do_remote_decode": True}
    for key in ("stream_options", "max_completion_tokens"):
        ask.pop(key, None)
    if isinstance(body.get("min_tokens"), int):
        ask["min_tokens"] = min(body["min_tokens"], 1)
    return ask


@dataclass(frozen=True, slots=True)
class First:
    """The prefill server's answer: its first token and the prompt's ids."""

    answer: dict[str, Any]
    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    finish_reason: str | None


def first_of(answer: Any) -> First | None:
    """The first token of a prefill answer; None when it lacks one or its text is not whole
    characters (the router then sends the client's own request to the decode server, which
    computes the prompt's last token)."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    c = choices[0]
    ids, prompt, text = c.get("token_ids"), c.get("prompt_token_ids"), c.get("text")
    if not (_is_ids(ids) and len(ids) == 1 and _is_ids(prompt) and isinstance(text, str)):
        return None
    if not text or text.endswith("\ufffd"):  # part of a character: the next token completes it
        return None
    return First(answer, text, ids, prompt, c.get("finish_reason"))


def decode_body(body: dict[str, Any], first: First, max_tokens: int, params: dict[str, Any]) -> dict[str, Any]:
    """The decode server's request: the prompt's ids and the first token, for the rest."""
    ask = {**body, "prompt": first.prompt_ids + first.token_ids, "max_tokens": max_tokens - 1}
    for key in ("max_completion_tokens", "truncation_side"):  # the prefill's prompt ids are final
        ask.pop(key, None)
    if isinstance(body.get("min_tokens"), int):
        ask["min_tokens"] = max(0, body["min_tokens"] - 1)
    return {**ask, "return_token_ids": True, "kv_transfer_params": params}


def _fix_choice(choice: dict[str, Any], first: First | None, want_ids: bool) -> None:
    """``choice`` of the decode server as the client's: the first token in front (``first``;
    None for later stream events), ids only where the client asked for them."""
    if first is not None:
        choice["text"] = first.text + (choice.get("text") or "")
        choice["token_ids"] = first.token_ids + (choice.get("token_ids") or [])
    if "prompt_token_ids" in choice:
        choice["prompt_token_ids"] = None
    if not want_ids:
        choice["token_ids"] = None


def _fix_usage(usage: Any) -> None:
    """The decode server counted the first token as a prompt token: it is a completion token."""
    if isinstance(usage, dict) and type(usage.get("prompt_tokens")) is int:
        done = usage.get("completion_tokens")
        usage["prompt_tokens"] -= 1
        usage["completion_tokens"] = (done if type(done) is int else 0) + 1


def merge(first: First, decoded: Any, want_ids: bool) -> dict[str, Any]:
    """The client's answer from the decode server's JSON answer (ValueError if it is not one)."""
    choices = decoded.get("choices") if isinstance(decoded, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices else None
    if not isinstance(choice, dict) or not isinstance(choice.get("text", ""), str):
        raise ValueError("the decode server's answer has no completion choice")
    if not isinstance(choice.get("token_ids") or [], list):
        raise ValueError("the decode server's answer has token_ids that are not a list")
    decoded.pop("kv_transfer_params", None)
    decoded["id"] = first.answer.get("id", decoded.get("id"))
    _fix_choice(choice, first, want_ids)
    if want_ids:
        decoded["choices"][0]["prompt_token_ids"] = first.prompt_ids
    _fix_usage(decoded.get("usage"))
    return decoded


def alone(first: First, want_ids: bool) -> dict[str, Any]:
    """The client's answer when the first token was also the last (EOS or a stop string)."""
    answer = {k: v for k, v in first.answer.items() if k != "kv_transfer_params"}
    choice = dict(answer["choices"][0])
    answer["choices"] = [choice]
    if not want_ids:
        choice["token_ids"] = choice["prompt_token_ids"] = None
    return answer


def alone_events(first: First, want_ids: bool, usage: bool) -> bytes:
    """:func:`alone` as the events of a stream (``usage``: the client asked for its chunk)."""
    answer = alone(first, want_ids)
    head = {k: answer.get(k) for k in ("id", "object", "created", "model")}
    out = event({**head, "choices": answer["choices"]})
    if usage:
        out += event({**head, "choices": [], "usage": answer.get("usage")})
    return out + b"data: [DONE]\n\n"


def event(data: dict[str, Any]) -> bytes:
    """One server-sent event."""
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


class StreamFixer:
    """Rewrites the decode server's events for the client, after :meth:`opening` (the first
    token's event, sent as soon as the prefill answered)."""

    def __init__(self, first: First, want_ids: bool) -> None:
        self.first, self.want_ids = first, want_ids
        self.id = first.answer.get("id")

    def opening(self) -> bytes:
        a, ids = self.first.answer, self.want_ids
        choice = {"index": 0, "text": self.first.text, "logprobs": None, "finish_reason": None, "stop_reason": None}
        choice["prompt_token_ids"] = self.first.prompt_ids if ids else None
        choice["token_ids"] = self.first.token_ids if ids else None
        return event(
            {
                "id": self.id,
                "object": "text_completion",
                "created": a.get("created"),
                "model": a.get("model"),
                "choices": [choice],
            }
        )

    def line(self, raw: bytes) -> bytes:
        """One line of the decode server's stream, as the client gets it."""
        if not raw.startswith(b"data: ") or raw.strip() == b"data: [DONE]":
            return raw
        try:
            data = json.loads(raw[6:])
        except (ValueError, RecursionError):
            return raw
        if not isinstance(data, dict) or "error" in data:
            return raw
        data["id"] = self.id
        for choice in data.get("choices") or []:
            if isinstance(choice, dict):
                _fix_choice(choice, None, self.want_ids)
        _fix_usage(data.get("usage"))
        return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n"
