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


LOOKUP = [{"type": "function", "function": {"name": "lookup"}}]


@pytest.mark.parametrize("body,want", [
    ({**CHAT, "stop": 5},
     "stop: expected a string or a list of strings, got a number"),
    ({**COMPLETION, "prompt": {"text": "hi"}},
     "prompt: expected a string, a list of integers, a list of strings or a list of lists of "
     "integers, got an object"),
    ({"model": "m", "messages": [{"role": "user", "content": 5}]},
     "messages.0.content: expected a string or a list of objects, got a number"),
    ({**CHAT, "tools": LOOKUP, "tool_choice": "any"},
     "tool_choice: Input should be 'none', 'auto' or 'required'"),
    ({**CHAT, "tools": LOOKUP, "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": LOOKUP}}},
     "tool_choice.type: Input should be 'function'"),
    ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "r", "schema": "an object"}}},
     "response_format.json_schema.schema: expected an object or a boolean, got a string"),
], ids=["stop", "prompt", "content", "tool_choice-str", "tool_choice-obj", "schema"])
def test_a_union_field_of_the_wrong_shape_names_its_shapes(body: dict[str, Any],
                                                           want: str) -> None:
    """A field that takes several shapes: the error speaks of the shape the client sent (its
    own errors when one shape is of that JSON kind, else the shapes it takes), never of
    pydantic's member tags (`stop.str:`, `tool_choice.literal['none','auto','required']:`)."""
    with pytest.raises(BadRequest) as err:
        _parse(body)
    assert err.value.message == want
    assert err.value.param == want.split(".")[0].split(":")[0]


def test_n_below_one_is_out_of_range_not_unsupported() -> None:
    with pytest.raises(BadRequest) as err:
        _parse({**CHAT, "n": 0})
    assert err.value.param == "n" and err.value.message == "n must be >= 1, got 0"
