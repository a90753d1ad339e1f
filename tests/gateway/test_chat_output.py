"""`ChatOutput` read both ways: the pieces a stream sends, assembled as a client assembles them,
make the message the non-streaming path returns (the parsers are real; no worker is needed)."""

from __future__ import annotations

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
