"""Fields the OpenAI API defines and Tandem does not honour are 400s that name the field, and
the same requests without them pass (no rule refuses a field's default)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.errors import BadRequest
from gateway.openai_types import ChatCompletionRequest, CompletionRequest, check_sampling
from gateway.request_body import parse_request

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}

REFUSED: list[tuple[dict[str, Any], dict[str, Any], str]] = [
    (CHAT, {"functions": [{"name": "f"}]}, "functions"),
    (CHAT, {"function_call": "auto"}, "function_call"),
    (CHAT, {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    (CHAT, {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    (CHAT, {"web_search_options": {}}, "web_search_options"),
    (CHAT, {"verbosity": "low"}, "verbosity"),
    (CHAT, {"modalities": ["text", "audio"]}, "modalities"),
    (COMPLETION, {"suffix": "tail"}, "suffix"),
    (COMPLETION, {"best_of": 3}, "best_of"),
    (COMPLETION, {"echo": True}, "echo"),
    (CHAT, {"store": True}, "store"),
    (CHAT, {"service_tier": "flex"}, "service_tier"),
    (CHAT, {"stream_options": {"include_usage": True}}, "stream_options"),
    (COMPLETION, {"stream_options": {"include_usage": True}}, "stream_options"),
    (CHAT, {"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options"),
    (CHAT, {"n": 129}, "n"),
    (COMPLETION, {"n": 2, "best_of": 1}, "best_of"),
    (CHAT, {"top_logprobs": 2}, "top_logprobs"),
    # 350000 stop strings in a 4 MB body, n=8, 20 tokens: 14 s of the gateway's event loop
    # (every stop is searched at every token of every choice), other clients stalled 2 s
    (COMPLETION, {"stop": [f"s{i}" for i in range(65)]}, "stop"),
    (CHAT, {"stop": [f"s{i}" for i in range(65)]}, "stop"),
]

ACCEPTED: list[tuple[dict[str, Any], dict[str, Any]]] = [
    (CHAT, {"modalities": ["text"], "store": False, "service_tier": "auto", "n": 1}),
    (COMPLETION, {"best_of": 1, "suffix": "", "echo": False}),
    (CHAT, {"n": 128}),
    (COMPLETION, {"n": 3, "best_of": 3}),
    (CHAT, {"stream": True, "stream_options": {"include_usage": True}}),
    (CHAT, {"logprobs": True, "top_logprobs": 2}),
    (CHAT, {"top_logprobs": 0}),
    (COMPLETION, {"stop": [f"s{i}" for i in range(64)]}),
]


def _check(base: dict[str, Any], extra: dict[str, Any]) -> None:
    cls = ChatCompletionRequest if "messages" in base else CompletionRequest
    check_sampling(parse_request(json.dumps({**base, **extra}).encode(), cls))


@pytest.mark.parametrize("base,extra,param", REFUSED, ids=[p for _, _, p in REFUSED])
def test_unhonoured_fields_are_refused_by_name(base: dict[str, Any], extra: dict[str, Any],
                                               param: str) -> None:
    with pytest.raises(BadRequest) as err:
        _check(base, extra)
    assert err.value.param == param, err.value.message


@pytest.mark.parametrize("base,extra", ACCEPTED)
def test_their_defaults_pass(base: dict[str, Any], extra: dict[str, Any]) -> None:
    _check(base, extra)


@pytest.mark.parametrize("kw,param", [
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
])
def test_a_bad_value_names_the_field_the_client_sent(kw: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as info:
        check_sampling(parse_request(json.dumps({**CHAT, **kw}).encode(), ChatCompletionRequest))
    assert info.value.param == param and info.value.message.startswith(
        param if param != "top_logprobs" else "at most 20"), info.value.message


@pytest.mark.parametrize("limit", ["max_completion_tokens", "max_tokens"])
def test_min_tokens_error_names_the_limit_the_client_sent(limit: str) -> None:
    """min_tokens over the limit: the message named max_tokens when the client had sent
    max_completion_tokens (a field its request does not hold)."""
    with pytest.raises(BadRequest) as info:
        check_sampling(parse_request(json.dumps({**CHAT, limit: 2, "min_tokens": 5}).encode(),
                                     ChatCompletionRequest))
    assert info.value.param == "min_tokens"
    assert f"<= {limit} (2)" in info.value.message, info.value.message


def test_the_refusal_quotes_the_value_as_json() -> None:
    """The client sent JSON: its value comes back as JSON, not as a Python repr."""
    with pytest.raises(BadRequest) as info:
        _check(CHAT, {"modalities": ["text", "audio"]})
    assert info.value.message.startswith('modalities ["text", "audio"] is not'), info.value.message
