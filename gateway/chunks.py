"""OpenAI stream events and completion bodies as bytes, without a pydantic round trip.

A streamed chunk differs from the previous one only in its text (and, rarely, logprobs or a
finish reason), so each request renders the fixed part once (`id`, `object`, `created`,
`model`) and every chunk is that prefix, the JSON-escaped text (orjson, ~0.1 us) and a
constant tail: two orders of magnitude cheaper than building and dumping the pydantic chunk
(~25 us). The bytes are exactly what `model_dump_json` of the pydantic models in
gateway/openai_responses.py gives (same keys, same order, same omitted fields;
tests/gateway/test_chunks.py holds them side by side); usage is rendered from its counts
(`UsageCounts`), and the rare logprobs by their models.
"""

from __future__ import annotations

import orjson

from gateway.agent_types import ToolCall
from gateway.openai_responses import ChatLogprobs, CompletionLogprobs, UsageCounts

_NULL = b"null"
_dumps = orjson.dumps

ROLE_DELTA = b'{"role":"assistant","content":""}'  # a chat stream's first delta
EMPTY_DELTA = b"{}"  # the delta that carries the finish reason


def content_delta(text: str) -> bytes:
    return b'{"content":' + _dumps(text) + b"}"


def reasoning_delta(text: str) -> bytes:
    return b'{"reasoning_content":' + _dumps(text) + b"}"


def call_delta(index: int, arguments: str, call_id: str | None = None,
               name: str | None = None) -> bytes:
    """A tool call's piece (ToolCallDelta's shape); the call's first has its id and name."""
    if call_id is None:
        return b'{"tool_calls":[{"index":%d,"function":{"arguments":%b}}]}' % (
            index, _dumps(arguments))
    return (b'{"tool_calls":[{"index":%d,"id":%b,"type":"function","function":{"name":%b,'
            b'"arguments":%b}}]}' % (index, _dumps(call_id), _dumps(name), _dumps(arguments)))


def _reason(finish_reason: str | None) -> bytes:
    return _NULL if finish_reason is None else _dumps(finish_reason)


def _head(rid: str, obj: str, created: int, model: str) -> bytes:
    return b'{"id":%b,"object":"%b","created":%d,"model":%b,"choices":' % (
        _dumps(rid), obj.encode(), created, _dumps(model))


def usage_json(usage: UsageCounts | None) -> bytes:
    """`Usage`'s JSON (completion_tokens_details only where a reasoning parser ran)."""
    if usage is None:
        return _NULL
    body = (b'{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d,'
            b'"prompt_tokens_details":{"cached_tokens":%d}' % (
                usage.prompt_tokens, usage.completion_tokens, usage.total_tokens,
                usage.cached_tokens))
    if usage.reasoning_tokens is not None:
        body += b',"completion_tokens_details":{"reasoning_tokens":%d}' % usage.reasoning_tokens
    return body + b"}"


class CompletionEvents:
    """`data:` events of one /v1/completions stream (CompletionChunk's shape)."""

    __slots__ = ("_head", "_text")

    def __init__(self, rid: str, created: int, model: str, index: int = 0) -> None:
        self._head = b"data: " + _head(rid, "text_completion", created, model)
        self._text = self._head + b'[{"index":%d,"text":' % index

    def text(self, text: str, finish_reason: str | None,
             logprobs: CompletionLogprobs | None = None, token_ids: list[int] | None = None,
             prompt_token_ids: list[int] | None = None) -> bytes:
        lp = _NULL if logprobs is None else logprobs.model_dump_json().encode()
        return b"".join((self._text, _dumps(text), b',"logprobs":', lp, b',"finish_reason":',
                         _reason(finish_reason), _ids(token_ids, prompt_token_ids),
                         b'}],"usage":null}\n\n'))

    def usage(self, usage: UsageCounts) -> bytes:
        return self._head + b'[],"usage":' + usage_json(usage) + b"}\n\n"


class ChatEvents:
    """`data:` events of one /v1/chat/completions stream (ChatCompletionChunk's shape)."""

    __slots__ = ("_head", "_delta")

    def __init__(self, rid: str, created: int, model: str, index: int = 0) -> None:
        self._head = b"data: " + _head(rid, "chat.completion.chunk", created, model)
        self._delta = self._head + b'[{"index":%d,"delta":' % index

    def delta(self, delta: bytes, finish_reason: str | None = None,
              logprobs: ChatLogprobs | None = None) -> bytes:
        lp = _NULL if logprobs is None else logprobs.model_dump_json().encode()
        return b"".join((self._delta, delta, b',"logprobs":', lp, b',"finish_reason":',
                         _reason(finish_reason), b'}],"usage":null}\n\n'))

    def usage(self, usage: UsageCounts) -> bytes:
        return self._head + b'[],"usage":' + usage_json(usage) + b"}\n\n"


def completion_body(rid: str, created: int, model: str, text: str, finish_reason: str | None,
                    logprobs: CompletionLogprobs | None, usage: UsageCounts | None,
                    token_ids: list[int] | None = None,
                    prompt_token_ids: list[int] | None = None) -> bytes:
    """A non-streamed /v1/completions response (CompletionResponse's shape)."""
    choice = completion_choice(0, text, finish_reason, logprobs, token_ids, prompt_token_ids)
    return choices_body(rid, "text_completion", created, model, [choice], usage)


def completion_choice(index: int, text: str, finish_reason: str | None,
                      logprobs: CompletionLogprobs | None, token_ids: list[int] | None = None,
                      prompt_token_ids: list[int] | None = None) -> bytes:
    """One choice of a non-streamed /v1/completions response (CompletionChoice's shape)."""
    lp = _NULL if logprobs is None else logprobs.model_dump_json().encode()
    return b"".join((b'{"index":%d,"text":' % index, _dumps(text), b',"logprobs":', lp,
                     b',"finish_reason":', _reason(finish_reason),
                     _ids(token_ids, prompt_token_ids), b"}"))


def chat_body(rid: str, created: int, model: str, content: str | None, reasoning: str | None,
              calls: list[ToolCall] | None, logprobs: ChatLogprobs | None,
              finish_reason: str | None, usage: UsageCounts | None) -> bytes:
    """A non-streamed /v1/chat/completions response (ChatCompletionResponse's shape)."""
    choice = chat_choice(0, content, reasoning, calls, logprobs, finish_reason)
    return choices_body(rid, "chat.completion", created, model, [choice], usage)


def chat_choice(index: int, content: str | None, reasoning: str | None,
                calls: list[ToolCall] | None, logprobs: ChatLogprobs | None,
                finish_reason: str | None) -> bytes:
    """One choice of a non-streamed chat response (ChatChoice's shape: reasoning and tool calls
    left out where None, content null in a turn of calls only)."""
    parts = [b'{"index":%d,"message":{"role":"assistant","content":' % index,
             _NULL if content is None else _dumps(content)]
    if reasoning is not None:
        parts += (b',"reasoning_content":', _dumps(reasoning))
    if calls is not None:
        parts += (b',"tool_calls":[', b",".join(
            b'{"id":%b,"type":"function","function":{"name":%b,"arguments":%b}}' % (
                _dumps(c.id), _dumps(c.function.name), _dumps(c.function.arguments))
            for c in calls), b"]")
    parts += (b'},"logprobs":', _NULL if logprobs is None else logprobs.model_dump_json().encode(),
              b',"finish_reason":', _reason(finish_reason), b"}")
    return b"".join(parts)


def choices_body(rid: str, obj: str, created: int, model: str, choices: list[bytes],
                 usage: UsageCounts | None) -> bytes:
    """A non-streamed response of `obj` ("text_completion", "chat.completion") from its
    choices' JSON (`completion_choice`, `chat_choice`)."""
    return b"".join((_head(rid, obj, created, model), b"[", b",".join(choices), b'],"usage":',
                     usage_json(usage), b"}"))


def _ids(token_ids: list[int] | None, prompt_token_ids: list[int] | None) -> bytes:
    """return_token_ids' fields of a completion choice; nothing where they are None."""
    out = b"" if token_ids is None else b',"token_ids":' + _dumps(token_ids)
    if prompt_token_ids is not None:
        out += b',"prompt_token_ids":' + _dumps(prompt_token_ids)
    return out
