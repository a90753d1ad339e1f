"""`ChatOutput` read both ways: the pieces a stream sends, assembled as a client assembles them,
make the message the non-streaming path returns (the parsers are real; no worker is needed)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from gateway.agents import ChatPlan
from gateway.chat_output import ChatOutput

CALL = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'


def both_ways(pieces: list[str], **plan: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the streamed pieces assembled, the message): content, reasoning and calls."""
    streamed = ChatOutput(ChatPlan(prompt_ids=[1], **plan))
    sent = [streamed.feed([p]) for p in pieces] + [streamed.finish()]
    calls: dict[int, str] = {}
    for piece in sent:
        for c in piece.calls:
            calls[c.index] = calls.get(c.index, "") + (c.name or "") + c.arguments
    stream = {"content": "".join(p.content for p in sent) or None,
              "reasoning": "".join(p.reasoning for p in sent) or None, "calls": calls}
    whole = ChatOutput(ChatPlan(prompt_ids=[1], **plan))
    whole.feed(["".join(pieces)])
    whole.finish()
    message = {"content": whole.message_content() or None,
               "reasoning": whole.message_reasoning(),
               "calls": {i: c.function.name + c.function.arguments
                         for i, c in enumerate(whole.calls)}}
    return stream, message


@pytest.mark.parametrize("pieces", [
    ["\n", "\n\t ", CALL],  # whitespace, then the call: no content either way
    ["\n\n", CALL, "\n", CALL],
    ["  ", CALL, "\n"],
    ["\n\n"],  # whitespace alone is the answer
    ["\n", "Hi", CALL],
    ["Hi", "\n\n", CALL],
    ["\n\n", "<tool_", "call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>"],
])
def test_whitespace_before_calls_streams_as_the_message_has_it(pieces: list[str]) -> None:
    stream, message = both_ways(pieces, tool_parser="hermes")
    assert stream == message


def test_whitespace_after_reasoning_before_calls() -> None:
    pieces = ["<think>\nhm", "\n</think>", "\n\n", CALL]
    stream, message = both_ways(pieces, tool_parser="hermes", reasoning_parser="qwen3")
    assert stream == message and message["content"] is None and message["calls"]


@pytest.mark.parametrize("parser,cut", [
    ("hermes", '\n<tool_call>\n{"name": "l'),
    ("hermes", "\n<tool_call>"),
    ("hermes", '\n<tool_call>\n{"arguments": {"a": 1}, "na'),
    ("qwen3_coder", "\n<tool_call>\n<funct"),
])
def test_a_call_cut_before_its_name_is_no_content(parser: str, cut: str) -> None:
    """max_tokens or a stop string ended the output inside a second call, before its name: the
    call's markup is not content (it was, after the first call's deltas: `<tool_call>\\n{"name":
    "l`), and the turn did not end in calls (finish_reason stays the worker's)."""
    first = (CALL if parser == "hermes" else
             "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>")
    stream, message = both_ways(["Hi\n", first, cut], tool_parser=parser)
    assert stream == message and message["content"] == "Hi\n" and len(message["calls"]) == 1
    out = ChatOutput(ChatPlan(prompt_ids=[1], tool_parser=parser))
    out.feed(["Hi\n" + first + cut])
    out.finish()
    assert out.finish_reason("stop") == "stop" and out.finish_reason("length") == "length"


def test_a_tool_call_marker_with_prose_after_it_is_content() -> None:
    """Not a call after all (the text after the marker is no JSON call): content, as before."""
    stream, message = both_ways(["See <tool_call> here"], tool_parser="hermes")
    assert stream == message and message["content"] == "See <tool_call> here"


@pytest.mark.parametrize("parser,text", [
    ("llama3_json", '{"answer": 3}'),
    ("hermes", '<tool_call>\n{"foo": 1}\n</tool_call>'),
    ("mistral", '[TOOL_CALLS][{"answer": 3}]'),
])
def test_a_json_object_with_no_name_is_content(parser: str, text: str) -> None:
    """A model's JSON answer (with tools on: a response_format's, or a Llama writing JSON) is
    not a call: it raised IndexError in the gateway (a call delta for call -1)."""
    stream, message = both_ways([text[:5], text[5:]], tool_parser=parser)
    assert stream == message and not message["calls"] and '{"' in message["content"]


MARKER_SOUP = [
    '<tool_call>', '</tool_call>', '\n', ' ', '{', '}', '[', ']', '"', ':', ',', '"name"',
    '"arguments"', '"parameters"', '"f"', '1', 'x', ';', '\\', 'null', '<think>', '</think>',
    '<|python_tag|>', '[TOOL_CALLS]', '[ARGS]', '[CALL_ID]', '<function=f>', '</function>',
    '<parameter=a>', '</parameter>', '<｜tool▁calls▁begin｜>', '<｜tool▁call▁begin｜>',
    '<｜tool▁sep｜>', '<｜tool▁call▁end｜>', '<｜tool▁calls▁end｜>', 'function', '```json', '```']


@pytest.mark.parametrize("parser", ["hermes", "qwen3_coder", "llama3_json", "mistral",
                                    "deepseek_v3", "deepseek_v31"])
def test_random_marker_soup_streams_what_the_message_says(parser: str) -> None:
    """Any text, split anywhere, assembles to the message, and nothing raises: found a crash
    (a nameless JSON object) and three ways the split decided what was kept."""
    rng = random.Random(parser)
    for _ in range(2000):
        text = "".join(rng.choice(MARKER_SOUP) for _ in range(rng.randint(1, 25)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text), rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        reasoning = rng.choice(["", "qwen3"])
        stream, message = both_ways(pieces, tool_parser=parser, reasoning_parser=reasoning)
        assert stream == message, (text, pieces)
