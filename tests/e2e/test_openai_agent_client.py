"""The official `openai` client against a 1P1D cluster serving a checkpoint with Qwen3's chat
template (tests/e2e/qwen3_chat_checkpoint.py; `auto` parsers: hermes and qwen3), as an agent
framework drives it: forced tool calls streamed and not, with n > 1, usage and logprobs; JSON
schemas streamed and not; outputs cut by max_completion_tokens; seeded sampling equal to mono.

The weights are random: free text means nothing, grammar-held output is well formed. So every
check here compares shapes (the stream assembles to the message, the client's pydantic models
parse every chunk) and what the grammar guarantees, never the model's judgement."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from tokenizers import Tokenizer

from orchestrator.launch.background import Cluster, running_cluster
from tests.e2e.qwen3_chat_checkpoint import build_qwen3_chat_checkpoint

pytestmark = pytest.mark.slow
PARSERS = ("gateway.tool_call_parser=auto", "gateway.reasoning_parser=auto")
WEATHER: dict[str, Any] = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME: dict[str, Any] = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "enum": ["utc", "cet"]}},
    "required": ["tz"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ANSWER = {"type": "object", "properties": {  # nested, arrays, enums, $ref / $defs
    "city": {"$ref": "#/$defs/city"},
    "days": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
             "maxItems": 3},
    "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}},
    "required": ["city", "days", "inner"], "additionalProperties": False,
    "$defs": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}}}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_qwen3_chat_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen3-chat")


def pinned(base: int, roles: tuple[str, ...] = ("prefill", "decode")) -> tuple[int, list[str]]:
    """Free ports by default; TANDEM_E2E_BASE_PORT=N pins the gateway and workers from
    N + base on (a machine shared under a port plan)."""
    first = os.environ.get("TANDEM_E2E_BASE_PORT")
    if not first:
        return 0, []
    port = int(first) + base
    return port, [f"roles.{r}.base_port={port + 1 + i}" for i, r in enumerate(roles)]


@pytest.fixture(scope="module")
def pd(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    port, sets = pinned(0)
    with running_cluster("configs/tiny-1p1d.yaml", *PARSERS, *sets, model=model, port=port,
                         tmp=tmp_path_factory.mktemp("pd")) as c:
        yield c
        c.wait_drained()  # raises unless every page and room was freed


def client(c: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{c.url}/v1", api_key="unused", max_retries=0, timeout=120)


def ask(c: Cluster, **kw: Any) -> Any:
    return client(c).chat.completions.create(model="qwen3-chat", **{"messages": ASK, **kw})


def message_of(choice: Any) -> dict[str, Any]:
    m = choice.message
    return {"content": m.content or "", "reasoning": getattr(m, "reasoning_content", None) or "",
            "calls": [(t.id, t.function.name, t.function.arguments) for t in m.tool_calls or []],
            "finish": choice.finish_reason,
            "tokens": [x.token for x in choice.logprobs.content] if choice.logprobs else []}


def streamed(c: Cluster, **kw: Any) -> tuple[dict[int, dict[str, Any]], Any]:
    """Each choice's stream assembled the way the client's helpers do, and the usage."""
    out: dict[int, dict[str, Any]] = {}
    usage = None
    for chunk in ask(c, stream=True, stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        for ch in chunk.choices:
            o = out.setdefault(ch.index, {"content": "", "reasoning": "", "calls": {},
                                          "finish": None, "tokens": []})
            o["content"] += ch.delta.content or ""
            o["reasoning"] += getattr(ch.delta, "reasoning_content", None) or ""
            for tc in ch.delta.tool_calls or []:
                if tc.id is not None:  # a call's first delta: id, type and name
                    assert tc.index == len(o["calls"]) and tc.type == "function", tc
                    o["calls"][tc.index] = [tc.id, tc.function.name, ""]
                o["calls"][tc.index][2] += tc.function.arguments or ""
            o["tokens"] += [x.token for x in ch.logprobs.content] if ch.logprobs else []
            if ch.finish_reason is not None:
                assert o["finish"] is None, "two finish reasons for one choice"
                o["finish"] = ch.finish_reason
    for o in out.values():
        o["calls"] = [tuple(v) for _, v in sorted(o["calls"].items())]
    return out, usage


def counts(usage: Any) -> tuple[int, int, int]:
    """Usage less cached_tokens (a second request finds the first one's prompt pages)."""
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def without_ids(m: dict[str, Any]) -> dict[str, Any]:
    return {**m, "calls": [c[1:] for c in m["calls"]]}  # each response draws its own ids


def same_but_ids(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return without_ids(a) == without_ids(b)


@pytest.mark.parametrize("choice,parallel", [
    ("required", True), ("required", False),
    ({"type": "function", "function": {"name": "get_time"}}, True)])
def test_forced_calls_streamed_assemble_to_the_message(pd: Cluster, choice: Any,
                                                       parallel: bool) -> None:
    kw = dict(tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=parallel, n=2,
              temperature=0.9, seed=11, max_completion_tokens=160, logprobs=True, top_logprobs=2,
              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    r = ask(pd, **kw)
    stream, usage = streamed(pd, **kw)
    assert counts(usage) == counts(r.usage)
    assert usage.completion_tokens == sum(len(m["tokens"]) for m in stream.values())
    for ch in r.choices:
        msg = message_of(ch)
        assert same_but_ids(stream[ch.index], msg), (stream[ch.index], msg)
        assert ch.message.content is None and msg["calls"]
        assert len(msg["calls"]) == 1 or parallel
        done = "tool_calls" if choice == "required" else "stop"  # OpenAI's: a named call stops
        assert msg["finish"] == done or (parallel and msg["finish"] == "length")
        allowed = ("get_weather", "get_time") if choice == "required" else ("get_time",)
        complete = msg["calls"] if msg["finish"] == done else msg["calls"][:-1]
        for call_id, name, _ in msg["calls"]:
            assert call_id.startswith("call_") and name in allowed
        for _, name, args in complete:
            jsonschema.validate(json.loads(args), SCHEMAS[name])


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                  "function": {"name": "get_weather"}}])
def test_forced_call_after_an_open_think_block(pd: Cluster, choice: Any) -> None:
    """Thinking on (Qwen3's default): the grammar lets a think block and a little whitespace
    come before the call. Whitespace alone before the call is no content: the stream used to
    send it as content where the message says null."""
    kw = dict(tools=[WEATHER, TIME], tool_choice=choice, temperature=0, max_completion_tokens=80)
    msg = message_of(ask(pd, **kw).choices[0])
    stream, _ = streamed(pd, **kw)
    assert same_but_ids(stream[0], msg), (stream[0], msg)
    done = "tool_calls" if choice == "required" else "stop"  # OpenAI's: a named call stops
    assert msg["finish"] == done and not msg["content"].strip()


@pytest.mark.parametrize("thinking", [False, True])
def test_json_schema_choices_streamed_and_not(pd: Cluster, thinking: bool) -> None:
    kw = dict(n=3, temperature=1.0, seed=5, max_completion_tokens=120,
              response_format={"type": "json_schema", "json_schema": {
                  "name": "answer", "strict": True, "schema": ANSWER}},
              extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
    r = ask(pd, **kw)
    stream, usage = streamed(pd, **kw)
    assert counts(usage) == counts(r.usage) and len(r.choices) == 3
    for ch in r.choices:
        msg = message_of(ch)
        assert same_but_ids(stream[ch.index], msg), (stream[ch.index], msg)
        if msg["finish"] == "stop":
            jsonschema.validate(json.loads(msg["content"]), ANSWER)
    assert any(ch.finish_reason == "stop" for ch in r.choices)


@pytest.mark.parametrize("kw", [
    {"tools": [WEATHER], "tool_choice": "required"},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}},
    {"response_format": {"type": "json_object"}}], ids=["call", "json_schema", "json_object"])
def test_a_cut_call_or_json_says_length(pd: Cluster, kw: dict[str, Any]) -> None:
    """max_completion_tokens ends the output inside the JSON: finish_reason "length", never
    "tool_calls" or "stop", and the text so far is not complete JSON."""
    kw = dict(kw, temperature=0, max_completion_tokens=14,
              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    msg = message_of(ask(pd, **kw).choices[0])
    stream, usage = streamed(pd, **kw)
    assert same_but_ids(stream[0], msg) and msg["finish"] == "length"
    assert usage.completion_tokens == 14
    for text in [msg["content"]] + [args for _, _, args in msg["calls"]]:
        with pytest.raises(ValueError):
            json.loads(text)


def test_tools_beside_a_response_format_stay_callable(pd: Cluster, model: Path) -> None:
    """Under "auto" the tools may still be called beside an output format (an agent
    framework's output type): the grammar used to allow only the JSON answer. The logit bias
    stands in for a model that wants to call (it also fills the call's unconstrained strings
    with the marker, so the call runs to the token budget)."""
    marker = Tokenizer.from_file(str(model / "tokenizer.json")).token_to_id("<tool_call>")
    kw = dict(tools=[WEATHER], temperature=0, max_completion_tokens=24,
              logit_bias={str(marker): 30},
              response_format={"type": "json_schema", "json_schema": {"name": "a",
                                                                      "schema": ANSWER}},
              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    msg = message_of(ask(pd, **kw).choices[0])
    assert [c[1] for c in msg["calls"]] == ["get_weather"] and not msg["content"], msg
    stream, _ = streamed(pd, **kw)
    assert same_but_ids(stream[0], msg)


def test_a_forced_call_beside_a_response_format(pd: Cluster) -> None:
    """An agent framework's output type and tool_choice "required" together (it was a 400):
    the forced turn is calls; the format waits for a turn that answers in text."""
    kw = dict(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
              temperature=0, max_completion_tokens=80,
              response_format={"type": "json_schema", "json_schema": {"name": "a",
                                                                      "schema": ANSWER}})
    msg = message_of(ask(pd, **kw).choices[0])
    assert msg["finish"] == "tool_calls" and len(msg["calls"]) == 1, msg
    stream, _ = streamed(pd, **kw)
    assert same_but_ids(stream[0], msg)


def test_a_budget_past_the_context_names_the_field_sent(pd: Cluster) -> None:
    """An agent framework sends max_completion_tokens: the 400 names it, not max_tokens."""
    with pytest.raises(openai.BadRequestError) as info:
        ask(pd, max_completion_tokens=5000)
    error = info.value.body
    assert isinstance(error, dict) and error["code"] == "context_length_exceeded"
    assert error["param"] == "max_completion_tokens" and "max_completion_tokens (5000)" in (
        error["message"])
