"""The official `openai` client against a gateway in front of scripted workers: tool calls,
streamed tool-call deltas, reasoning, the wire fields sent, and the 400s."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.tokenizer import Tokenizer
from tests.gateway.gw_doubles import Script, ScriptedWorker, fast_config, workers

pytestmark = pytest.mark.anyio

LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}
MESSAGES = [{"role": "user", "content": "q?"}]
THINK = "<think>\nq is not given: look it up\n</think>"
CALL_Q = '<tool_call>\n{"name": "lookup", "arguments": {"name": "q"}}\n</tool_call>'
CALL_R = '<tool_call>\n{"name": "lookup", "arguments": {"name": "r"}}\n</tool_call>'


@contextlib.asynccontextmanager
async def client_for(config: GatewayConfig) -> AsyncIterator[openai.AsyncOpenAI]:
    app = create_app(config)
    async with app.router.lifespan_context(app):
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw",
                                 timeout=20)
        async with http:
            yield openai.AsyncOpenAI(base_url="http://gw/v1", api_key="none", http_client=http,
                                     max_retries=0)


def scripted(tok_dir: Path, text: str) -> ScriptedWorker:
    ids = Tokenizer.from_dir(tok_dir).encode(text, add_special_tokens=False)
    return ScriptedWorker(vocab_size=400, max_model_len=4096,
                          script=Script(tokens=ids, finish_reason="stop"))


async def collect(stream: Any) -> dict[str, Any]:
    """A streamed answer assembled the way OpenAI clients do it."""
    out: dict[str, Any] = {"content": "", "reasoning": "", "calls": {}, "finish": None,
                           "first_call_deltas": []}
    async for chunk in stream:
        if not chunk.choices:
            out["usage"] = chunk.usage
            continue
        ch = chunk.choices[0]
        d = ch.delta
        out["content"] += d.content or ""
        out["reasoning"] += getattr(d, "reasoning_content", None) or ""
        for tc in d.tool_calls or []:
            if tc.index not in out["calls"]:
                assert tc.id and tc.type == "function" and tc.function.name  # name first
                out["first_call_deltas"].append(tc)
                out["calls"][tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            else:
                assert tc.id is None and tc.function.name is None
            out["calls"][tc.index]["arguments"] += tc.function.arguments or ""
        out["finish"] = ch.finish_reason or out["finish"]
    return out


async def test_tool_call_with_reasoning_stream_and_not(hermes_dir: Path) -> None:
    w = scripted(hermes_dir, f"{THINK}\n\n{CALL_Q}")
    async with workers(w), client_for(fast_config(hermes_dir, workers=(w.url,))) as client:
        r = await client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[LOOKUP])
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls"
        assert msg.content is None and msg.reasoning_content == "q is not given: look it up"
        (call,) = msg.tool_calls
        assert call.type == "function" and call.function.name == "lookup"
        assert json.loads(call.function.arguments) == {"name": "q"} and call.id.startswith("call_")
        tok = Tokenizer.from_dir(hermes_dir)
        n_think = len(tok.encode(THINK, add_special_tokens=False))
        assert r.usage.completion_tokens_details.reasoning_tokens == n_think

        stream = await client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=[LOOKUP], stream=True,
            stream_options={"include_usage": True})
        got = await collect(stream)
        assert got["finish"] == "tool_calls" and got["content"] == ""
        assert got["reasoning"] == msg.reasoning_content
        assert [(c["name"], json.loads(c["arguments"])) for c in got["calls"].values()] == \
            [("lookup", {"name": "q"})]
        assert got["first_call_deltas"][0].function.arguments == ""
        assert got["usage"].completion_tokens_details.reasoning_tokens == n_think
        # auto: the tools reached the template and nothing forced a call
        sent = w.requests[0]
        assert "<tools>" in tok.decode(list(sent.prompt_token_ids), skip_special_tokens=False)
        assert not sent.sampling.HasField("structured")


async def test_parallel_calls_and_their_stream(hermes_dir: Path) -> None:
    w = scripted(hermes_dir, f"Looking both up.\n{CALL_Q}\n{CALL_R}")
    async with workers(w), client_for(fast_config(hermes_dir, workers=(w.url,))) as client:
        r = await client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[LOOKUP])
        msg = r.choices[0].message
        assert msg.content == "Looking both up.\n"
        assert [json.loads(c.function.arguments)["name"] for c in msg.tool_calls] == ["q", "r"]
        assert len({c.id for c in msg.tool_calls}) == 2
        got = await collect(await client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=[LOOKUP], stream=True))
        assert got["content"] == msg.content and sorted(got["calls"]) == [0, 1]
        assert [c["arguments"] for c in got["calls"].values()] == \
            [c.function.arguments for c in msg.tool_calls]


@pytest.mark.parametrize("stream", [False, True])
async def test_parallel_tool_calls_false_stops_after_one(hermes_dir: Path, stream: bool) -> None:
    w = scripted(hermes_dir, f"{CALL_Q}\n{CALL_R}\nand more text")
    w.script.delay_s = 0.005
    async with workers(w), client_for(fast_config(hermes_dir, workers=(w.url,))) as client:
        kw: dict[str, Any] = dict(model="tiny", messages=MESSAGES, tools=[LOOKUP],
                                  parallel_tool_calls=False)
        if stream:
            got = await collect(await client.chat.completions.create(stream=True, **kw))
            calls, finish = list(got["calls"].values()), got["finish"]
        else:
            r = await client.chat.completions.create(**kw)
            calls = [{"arguments": c.function.arguments} for c in r.choices[0].message.tool_calls]
            finish = r.choices[0].finish_reason
        assert finish == "tool_calls" and [json.loads(c["arguments"]) for c in calls] == \
            [{"name": "q"}]
        await w.abort_event.wait()  # the rest of the output was not generated


@pytest.mark.parametrize("stream", [False, True])
async def test_a_call_cut_by_a_stop_string_is_not_finish_reason_tool_calls(
        hermes_dir: Path, stream: bool) -> None:
    """A stop string inside a call leaves its arguments unfinished JSON: the turn did not end
    in a call a client can run, as when max_tokens cuts one ("length")."""
    w = scripted(hermes_dir, CALL_Q)
    async with workers(w), client_for(fast_config(hermes_dir, workers=(w.url,))) as client:
        kw: dict[str, Any] = dict(model="tiny", messages=MESSAGES, tools=[LOOKUP], stop=['"q'])
        if stream:
            finish = (await collect(await client.chat.completions.create(stream=True, **kw)))[
                "finish"]
        else:
            finish = (await client.chat.completions.create(**kw)).choices[0].finish_reason
        assert finish == "stop"


async def test_reasoning_split_from_content(hermes_dir: Path) -> None:
    w = scripted(hermes_dir, "<think>\nk = 3 so k + 1 = 4\n</think>\n\nThe answer is 4.")
    async with workers(w), client_for(fast_config(hermes_dir, workers=(w.url,))) as client:
        r = await client.chat.completions.create(model="tiny", messages=MESSAGES)
        msg = r.choices[0].message
        assert (msg.reasoning_content, msg.content) == ("k = 3 so k + 1 = 4", "The answer is 4.")
        assert r.choices[0].finish_reason == "stop"
        got = await collect(await client.chat.completions.create(model="tiny", messages=MESSAGES,
                                                                 stream=True))
        assert (got["reasoning"], got["content"]) == (msg.reasoning_content, msg.content)


@pytest.mark.parametrize("stop", [None, ["zzz"]])
async def test_reasoning_tokens_of_an_answer_cut_inside_its_reasoning(hermes_dir: Path,
                                                                      stop: Any) -> None:
    """Cut by max_tokens inside <think>: every completion token is a reasoning token, never
    more (the text released at the end, held by the detokenizer or a stop string, counted as
    one or two more tokens)."""
    w = scripted(hermes_dir, "<think>\nk = 3 so k + 1")
    w.script.finish_reason = "length"
    n = len(w.script.tokens)
    async with workers(w), client_for(fast_config(hermes_dir, workers=(w.url,))) as client:
        r = await client.chat.completions.create(model="tiny", messages=MESSAGES, stop=stop)
        assert r.choices[0].message.reasoning_content == "k = 3 so k + 1"
        assert r.usage.completion_tokens == n
        assert r.usage.completion_tokens_details.reasoning_tokens == n
        got = await collect(await client.chat.completions.create(
            model="tiny", messages=MESSAGES, stop=stop, stream=True,
            stream_options={"include_usage": True}))
        assert got["reasoning"] == "k = 3 so k + 1"
        assert got["usage"].completion_tokens == n
        assert got["usage"].completion_tokens_details.reasoning_tokens == n


async def test_wire_fields(hermes_dir: Path) -> None:
    w = scripted(hermes_dir, CALL_Q)
    async with workers(w), client_for(fast_config(hermes_dir, workers=(w.url,))) as client:
        await client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=[LOOKUP], tool_choice="required",
            logit_bias={"7": -100, "9": 5})
        s = w.requests[-1].sampling
        assert dict(s.logit_bias) == {7: -100.0, 9: 5.0}
        assert s.structured.WhichOneof("kind") == "structural_tag"
        tag = s.structured.structural_tag
        assert json.loads(tag)["type"] == "structural_tag" and '"name\\": \\"lookup\\"' in tag
        schema = {"type": "json_schema", "json_schema": {
            "name": "r", "schema": {"type": "object"}, "strict": True}}
        await client.chat.completions.create(model="tiny", messages=MESSAGES,
                                             response_format=schema)
        s = w.requests[-1].sampling
        # A reasoning parser is on (the template writes <think>): the schema follows the block.
        assert s.structured.WhichOneof("kind") == "structural_tag"
        assert '"json_schema": {"type": "object"}' in s.structured.structural_tag
        await client.chat.completions.create(
            model="tiny", messages=MESSAGES, response_format=schema,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        # Thinking off, the prompt closed the block: the schema alone, from the first token.
        assert w.requests[-1].sampling.structured.json_schema == '{"type": "object"}'


async def test_mistral_special_markers_survive_skip_special_tokens(hermes_dir: Path) -> None:
    w = scripted(hermes_dir, '[TOOL_CALLS]lookup[ARGS]{"name": "q"}')
    async with workers(w), client_for(fast_config(hermes_dir, workers=(w.url,),
                                                  tool_call_parser="mistral")) as client:
        r = await client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[LOOKUP])
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "lookup" and len(call.id) == 9 and call.id.isalnum()


@pytest.mark.parametrize("kw,param", [
    ({"tools": [LOOKUP]}, "tools"),  # the plain test template does not render tools
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    # a name the template leaves out of the prompt (the openai client sends it as given)
    ({"messages": [{"role": "user", "content": "hi", "name": "ann"}]}, "messages"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"extra_body": {"chat_template_kwargs": {"enable_thinking": True}}},
     "chat_template_kwargs"),
    ({"extra_body": {"guided_json": "{oops"}}, "guided_json"),
    ({"extra_body": {"no_such_field": 1}}, "no_such_field"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
])
async def test_refused_with_openai_errors(tok_dir: Path, kw: dict[str, Any], param: str) -> None:
    w = scripted(tok_dir, "hello")
    async with workers(w), client_for(fast_config(tok_dir, workers=(w.url,))) as client:
        body: dict[str, Any] = {"model": "tiny", "messages": MESSAGES, **kw}
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(**body)
        err = info.value.body
        assert isinstance(err, dict) and err["param"] == param, err
        assert err["type"] == "invalid_request_error" and err["message"]
        assert not w.requests  # refused before any worker saw it


async def test_stream_helper_message_fed_back_with_the_tool_result(hermes_dir: Path) -> None:
    """The tool loop of the openai client's stream helper: its final message (a
    ParsedChatCompletionMessage) goes back as the next turn's history, and the client sends the
    fields it derived from the answer (`parsed`, each call's `index` and
    `function.parsed_arguments`). They repeat what the message already says: accepted, as
    OpenAI and vLLM accept them, and kept out of the prompt."""
    w = scripted(hermes_dir, CALL_Q)
    async with workers(w), client_for(fast_config(hermes_dir, workers=(w.url,))) as client:
        async with client.chat.completions.stream(model="tiny", messages=MESSAGES,
                                                  tools=[LOOKUP]) as s:
            msg = (await s.get_final_completion()).choices[0].message
        (call,) = msg.tool_calls
        history = [*MESSAGES, msg, {"role": "tool", "tool_call_id": call.id, "content": "42"}]
        await client.chat.completions.create(model="tiny", messages=history, tools=[LOOKUP])
        prompt = Tokenizer.from_dir(hermes_dir).decode(
            list(w.requests[-1].prompt_token_ids), skip_special_tokens=False)
        assert '{"name": "lookup", "arguments": {"name": "q"}}' in prompt
        assert "<tool_response>\n42\n</tool_response>" in prompt
        assert "parsed" not in prompt and "index" not in prompt
