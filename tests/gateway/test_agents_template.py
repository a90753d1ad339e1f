"""Chat template inputs for agents: tools, tool calls and results, template kwargs, roles,
and the 400s for what a template or a parser cannot honour (`plan_chat`, no workers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gateway.agents import Parsers, plan_chat
from gateway.errors import BadRequest
from gateway.openai_types import ChatCompletionRequest
from gateway.request_body import parse_request
from gateway.tokenizer import Tokenizer
from orchestrator.launch.background import EMBEDDED_MODEL

LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Look up a variable's value (<, > and & kept as is).",
    "parameters": {"type": "object", "properties": {"name": {"type": "string"}},
                   "required": ["name"]}}}
HERMES = Parsers(reasoning="qwen3", tool_call="hermes")


def request(**kw: Any) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "q?"}], **kw}
    return parse_request(json.dumps(body).encode(), ChatCompletionRequest)


def prompt(tok: Tokenizer, req: ChatCompletionRequest, parsers: Parsers = HERMES) -> str:
    plan = plan_chat(req, tok, parsers)
    return tok.decode(plan.prompt_ids, skip_special_tokens=False)


def refused(tok: Tokenizer, parsers: Parsers = HERMES, **kw: Any) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        plan_chat(request(**kw), tok, parsers)
    return info.value


def test_tools_render_like_transformers(hermes_dir: Path) -> None:
    tok = Tokenizer.from_dir(hermes_dir)
    text = prompt(tok, request(tools=[LOOKUP]))
    # tojson is json.dumps: no HTML escapes, keys in the order given, non-ASCII kept.
    assert json.dumps(LOOKUP) in text
    assert "\\u003c" not in text and "<tools>" in text


def test_history_with_calls_and_results(hermes_dir: Path) -> None:
    tok = Tokenizer.from_dir(hermes_dir)
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "q"}, {"type": "text", "text": "?"}]},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "lookup", "arguments": "{\"name\": \"q\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "7"},
    ]
    text = prompt(tok, request(messages=messages, tools=[LOOKUP]))
    assert "<|im_start|>system\nBe brief." in text  # developer is the system role
    assert "<|im_start|>user\nq?<|im_end|>" in text  # text parts joined
    # The JSON-text arguments reached the template as a mapping (rendered by tojson).
    assert '<tool_call>\n{"name": "lookup", "arguments": {"name": "q"}}\n</tool_call>' in text
    assert "<tool_response>\n7\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_enable_thinking_kwarg_and_reasoning_start(hermes_dir: Path, open_think_dir: Path) -> None:
    tok = Tokenizer.from_dir(hermes_dir)
    off = plan_chat(request(chat_template_kwargs={"enable_thinking": False}), tok, HERMES)
    assert tok.decode(off.prompt_ids, skip_special_tokens=False).endswith(
        "<think>\n\n</think>\n\n")
    assert not off.starts_in_reasoning
    opened = plan_chat(request(), Tokenizer.from_dir(open_think_dir), HERMES)
    assert opened.starts_in_reasoning


def test_tool_choice_none_renders_and_parses_no_tools(hermes_dir: Path) -> None:
    tok = Tokenizer.from_dir(hermes_dir)
    plan = plan_chat(request(tools=[LOOKUP], tool_choice="none"), tok, HERMES)
    assert "<tools>" not in tok.decode(plan.prompt_ids, skip_special_tokens=False)
    assert plan.tool_parser == "" and plan.structured is None


def test_auto_tools_parse_without_constraint(hermes_dir: Path) -> None:
    plan = plan_chat(request(tools=[LOOKUP]), Tokenizer.from_dir(hermes_dir), HERMES)
    assert plan.tool_parser == "hermes" and plan.structured is None
    assert plan.tool_parameters["lookup"]["required"] == ["name"]


@pytest.mark.parametrize("kw,param,words", [
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages", "role"),
    ({"messages": [{"role": "tool", "content": "7"}]}, "messages", "tool_call_id"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url":
      "https://x/y.png"}}]}]}, "messages", "'image_url' is not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control":
      {}}]}]}, "messages", "'cache_control'"),
    # an echoed message's annotations, or its reasoning under both names: one was dropped
    ({"messages": [{"role": "assistant", "content": "a", "annotations": [{"type":
      "url_citation"}]}]}, "messages", "annotations"),
    ({"messages": [{"role": "assistant", "content": "a", "reasoning_content": "x", "reasoning":
      "y"}]}, "messages", "differ"),
    # a part without its text (or its type) was read as empty text
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages",
     "content[0].text is required"),
    ({"messages": [{"role": "user", "content": [{"text": "hi"}]}]}, "messages",
     "content.0.type: Field required"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type":
      "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, "messages",
     "arguments"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [LOOKUP], "tool_choice": {"type": "function", "function": {"name": "other"}}},
     "tool_choice", "not in tools"),
    ({"tools": [LOOKUP, LOOKUP]}, "tools", "twice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "must match"),
    ({"chat_template_kwargs": {"not_read": 1}}, "chat_template_kwargs", "does not read"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "may not set"),
    # documents is no request field here: the 400 sent the client to one ("send it as the
    # request field"), which was then "Unrecognized request argument"
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs",
     "send it as the request field"),
    ({"chat_template_kwargs": {"documents": []}}, "chat_template_kwargs",
     "'documents' is not supported"),
    ({"reasoning_effort": "high"}, "reasoning_effort", "does not read"),
])
def test_bad_agent_inputs_are_400s(hermes_dir: Path, kw: dict[str, Any], param: str,
                                   words: str) -> None:
    tok = Tokenizer.from_dir(hermes_dir)
    with pytest.raises(BadRequest) as info:
        plan_chat(request(**kw), tok, HERMES)
    assert info.value.param == param and words in info.value.message, info.value.message


def test_tools_without_parser_are_400(hermes_dir: Path) -> None:
    err = refused(Tokenizer.from_dir(hermes_dir), Parsers(), tools=[LOOKUP])
    assert err.param == "tools" and "--tool-call-parser" in err.message


def test_embedded_model_template(tmp_path: Path) -> None:
    """The embedded model's current template: messages render; tools and kwargs it does not
    read are refused rather than dropped."""
    tok = Tokenizer.from_dir(EMBEDDED_MODEL)
    if "tools" in tok.template_vars:  # the retrained model (issue 17) renders tools
        assert "<tool_call>" in tok.template_source
        return
    plan = plan_chat(request(), tok, Parsers())
    assert tok.decode(plan.prompt_ids, skip_special_tokens=False).startswith("<|user|>q?")
    assert refused(tok, HERMES, tools=[LOOKUP]).param == "tools"
    assert refused(tok, Parsers(), chat_template_kwargs={"enable_thinking": True}).param == \
        "chat_template_kwargs"


def test_unknown_fields_are_refused_by_name() -> None:
    with pytest.raises(BadRequest) as info:
        parse_request(b'{"messages": [], "toolz": []}', ChatCompletionRequest)
    assert info.value.message == "Unrecognized request argument supplied: toolz"
    assert info.value.param == "toolz"
    with pytest.raises(BadRequest) as info:
        parse_request(b'{"messages": [{"role": "user", "content": "x", "colour": 1}]}',
                      ChatCompletionRequest)
    assert "messages.0.colour" in info.value.message


NAMED_TEMPLATE = """\
{%- for message in messages -%}
<|im_start|>{{ message.role }}{% if message.role == 'user' and message.name %} \
({{ message.name }}){% endif %}
{{ message.content }}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}"""


def test_a_message_name_the_template_drops_is_a_400(hermes_dir: Path) -> None:
    err = refused(Tokenizer.from_dir(hermes_dir), messages=[
        {"role": "system", "content": "s"}, {"role": "user", "content": "q?", "name": "ann"}])
    assert err.param == "messages" and err.message.startswith("messages[1].name: "), err.message


def test_a_message_name_the_template_reads_reaches_the_prompt(tmp_path: Path) -> None:
    from tests.gateway.gw_tokenizers import build_agent_tokenizer

    tok = Tokenizer.from_dir(build_agent_tokenizer(tmp_path, NAMED_TEMPLATE))
    users = [{"role": "user", "content": "q?", "name": "ann"},
             {"role": "assistant", "content": "a"}, {"role": "user", "content": "r?"}]
    assert "<|im_start|>user (ann)" in prompt(tok, request(messages=users))
    err = refused(tok, messages=[*users, {"role": "assistant", "content": "b", "name": "bot"}])
    assert err.message.startswith("messages[3].name: ") and "an assistant message's name" in \
        err.message, err.message  # not "a assistant"


PREFILL = [{"role": "user", "content": "q?"}, {"role": "assistant", "content": "q=4 "}]


def test_continue_final_message_renders_as_transformers(hermes_dir: Path) -> None:
    """vLLM's / SGLang's assistant prefill: `add_generation_prompt: false` with
    `continue_final_message: true` leaves the last message open for the model to go on (the
    text transformers' apply_chat_template renders); each alone as transformers has it."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(hermes_dir))
    tok = Tokenizer.from_dir(hermes_dir)
    for kw in ({"add_generation_prompt": False, "continue_final_message": True},
               {"add_generation_prompt": False}, {"add_generation_prompt": True}):
        want = hf.apply_chat_template(PREFILL, tokenize=False, **kw)
        assert prompt(tok, request(messages=PREFILL, **kw)) == want, kw
    assert prompt(tok, request(messages=PREFILL, continue_final_message=True,
                               add_generation_prompt=False)).endswith("assistant\nq=4 ")


@pytest.mark.parametrize("kw,words", [
    ({"continue_final_message": True}, "both"),  # add_generation_prompt is true by default
    ({"continue_final_message": True, "add_generation_prompt": False,
      "messages": [{"role": "user", "content": "   "}]}, "no text to continue"),
])
def test_continue_final_message_refusals(hermes_dir: Path, kw: dict[str, Any],
                                         words: str) -> None:
    err = refused(Tokenizer.from_dir(hermes_dir), **{"messages": PREFILL, **kw})
    assert err.param == "continue_final_message" and words in err.message, err.message
