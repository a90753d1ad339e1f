"""Requests as the official `openai` client and other OpenAI clients send them.

The openai client sends `null` for a keyword given as None (`n=None`), and the OpenAI API
defines most sampling fields as nullable: null means "the default", as if the field were left
out. A required field (`prompt`, `messages`) stays required.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.agents import template_message
from gateway.errors import BadRequest
from gateway.openai_types import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    check_sampling,
)
from gateway.request_body import parse_request

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}

# Fields OpenAI declares nullable, plus the vLLM / SGLang extensions (Optional there).
CHAT_NULLABLE = ["n", "stream", "presence_penalty", "frequency_penalty", "logprobs",
                 "parallel_tool_calls", "top_k", "min_p", "min_tokens", "ignore_eos",
                 "skip_special_tokens", "repetition_penalty"]
COMPLETION_NULLABLE = ["n", "stream", "echo", "presence_penalty", "frequency_penalty",
                       "return_token_ids"]


def _parse(body: dict[str, Any]) -> Any:
    cls = ChatCompletionRequest if "messages" in body else CompletionRequest
    req = parse_request(json.dumps(body).encode(), cls)
    check_sampling(req)
    return req


@pytest.mark.parametrize("field", CHAT_NULLABLE)
def test_chat_null_is_the_default(field: str) -> None:
    req = _parse({**CHAT, field: None})
    assert getattr(req, field) == ChatCompletionRequest.model_fields[field].default


@pytest.mark.parametrize("field", COMPLETION_NULLABLE)
def test_completion_null_is_the_default(field: str) -> None:
    req = _parse({**COMPLETION, field: None})
    assert getattr(req, field) == CompletionRequest.model_fields[field].default


@pytest.mark.parametrize("body,param", [({"model": "m", "prompt": None}, "prompt"),
                                        ({"model": "m", "messages": None}, "messages")])
def test_a_required_field_stays_required(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as err:
        _parse(body)
    assert err.value.param == param


@pytest.mark.parametrize("role", ["user", "system", "developer", "tool"])
def test_a_message_without_content_is_refused(role: str) -> None:
    """`{"role": "user"}` rendered as an empty turn would answer a question nobody asked."""
    msg = ChatMessage.model_validate({"role": role, "tool_call_id": "c1"} if role == "tool"
                                     else {"role": role})
    with pytest.raises(BadRequest) as err:
        template_message(msg, 0)
    assert err.value.param == "messages" and "messages[0].content" in err.value.message


def test_an_assistant_turn_may_omit_content() -> None:
    msg = ChatMessage.model_validate({"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]})
    assert template_message(msg, 0)["content"] == ""


@pytest.mark.parametrize("field,value", [("stream", "yes"), ("stream", "false"),
                                         ("max_tokens", "5"), ("max_tokens", 5.0),
                                         ("temperature", "0.5"), ("logprobs", "true"),
                                         ("ignore_eos", 1)])
def test_a_value_of_the_wrong_type_is_refused_not_converted(field: str, value: Any) -> None:
    """OpenAI answers 400 to `"stream": "yes"`; converting it would guess what the client
    meant ("false" is a non-empty string, "yes" a word)."""
    with pytest.raises(BadRequest) as err:
        _parse({**CHAT, field: value})
    assert err.value.param == field


def test_an_integer_is_a_number() -> None:
    assert _parse({**CHAT, "temperature": 1, "top_p": 1}).temperature == 1.0
