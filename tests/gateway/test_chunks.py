"""The byte-built stream events and bodies (gateway/chunks.py) equal the pydantic models'
JSON byte for byte: same keys, same order, same omitted fields, same escaping."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.agent_types import FunctionCall, FunctionCallDelta, ToolCall, ToolCallDelta
from gateway.chat_output import CallPiece, ChatPiece
from gateway.chunks import (
    EMPTY_DELTA,
    ROLE_DELTA,
    ChatEvents,
    CompletionEvents,
    chat_body,
    completion_body,
    usage_json,
)
from gateway.openai_responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobEntry,
    ChatLogprobs,
    ChatMessageOut,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    CompletionTokensDetails,
    PromptTokensDetails,
    TopLogprobEntry,
    Usage,
    UsageCounts,
)

# Text as detokenizers give it: any Unicode scalar (no lone surrogates), controls included.
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
REASON = st.sampled_from([None, "stop", "length", "abort", "tool_calls"])


def call_model(c: CallPiece) -> ToolCallDelta:
    """A call piece in the pydantic shape (a first piece: id, type and name, no arguments)."""
    if c.id is None:
        return ToolCallDelta(index=c.index, function=FunctionCallDelta(arguments=c.arguments))
    return ToolCallDelta(index=c.index, id=c.id, type="function",
                         function=FunctionCallDelta(name=c.name, arguments=c.arguments))


def pydantic_deltas(piece: ChatPiece) -> list[ChatDelta]:
    """The reference for `ChatPiece.delta_json`: the same deltas as pydantic models."""
    out = []
    if piece.reasoning:
        out.append(ChatDelta(reasoning_content=piece.reasoning))
    if piece.content:
        out.append(ChatDelta(content=piece.content))
    out.extend(ChatDelta(tool_calls=[call_model(c)]) for c in piece.calls)
    return out


def usage_model(u: UsageCounts) -> Usage:
    """The pydantic Usage the counts stand for (the reference the bytes are held to)."""
    details = None if u.reasoning_tokens is None else CompletionTokensDetails(
        reasoning_tokens=u.reasoning_tokens)
    return Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                 total_tokens=u.total_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=u.cached_tokens),
                 completion_tokens_details=details)


def sse(model: object) -> bytes:
    return b"data: " + model.model_dump_json().encode() + b"\n\n"  # type: ignore[attr-defined]


@settings(max_examples=300, deadline=None)
@given(text=TEXT, reason=REASON, rid=TEXT, model=TEXT, created=st.integers(0, 2**40))
def test_completion_chunk_bytes(text: str, reason: str | None, rid: str, model: str,
                                created: int) -> None:
    want = sse(CompletionChunk(id=rid, created=created, model=model, choices=[
        CompletionChoice(text=text, finish_reason=reason)]))
    assert CompletionEvents(rid, created, model).text(text, reason) == want


@settings(max_examples=300, deadline=None)
@given(content=TEXT, reasoning=TEXT, reason=REASON, rid=TEXT)
def test_chat_delta_bytes(content: str, reasoning: str, reason: str | None, rid: str) -> None:
    ev = ChatEvents(rid, 7, "m")
    piece = ChatPiece(reasoning=reasoning, content=content)
    assert len(piece.delta_json()) == len(pydantic_deltas(piece))
    for fast, delta in zip(piece.delta_json(), pydantic_deltas(piece), strict=True):
        want = sse(ChatCompletionChunk(id=rid, created=7, model="m", choices=[
            ChatChunkChoice(delta=delta, finish_reason=reason)]))
        assert ev.delta(fast, reason) == want


@settings(max_examples=300, deadline=None)
@given(index=st.integers(0, 99), args=TEXT, call_id=st.one_of(st.none(), TEXT), name=TEXT)
def test_tool_call_piece_bytes(index: int, args: str, call_id: str | None, name: str) -> None:
    piece = ChatPiece(calls=[CallPiece(index, args, call_id, None if call_id is None else name)])
    (fast,), (delta,) = piece.delta_json(), pydantic_deltas(piece)
    assert ChatEvents("r", 1, "m").delta(fast) == sse(ChatCompletionChunk(
        id="r", created=1, model="m", choices=[ChatChunkChoice(delta=delta)]))


def test_chat_role_empty_and_tool_call_deltas() -> None:
    ev = ChatEvents("chatcmpl-1", 3, "tiny")

    def want(delta: ChatDelta, **kw: object) -> bytes:
        return sse(ChatCompletionChunk(id="chatcmpl-1", created=3, model="tiny", choices=[
            ChatChunkChoice(delta=delta, **kw)]))

    assert ev.delta(ROLE_DELTA) == want(ChatDelta(role="assistant", content=""))
    assert ev.delta(EMPTY_DELTA, "stop") == want(ChatDelta(), finish_reason="stop")
    calls = [CallPiece(0, id="call_1", name="lookup"), CallPiece(0, '{"name": "q"}')]
    piece = ChatPiece(content="x", calls=calls)
    assert call_model(calls[0]) == ToolCallDelta(index=0, id="call_1", type="function", function=
                                             FunctionCallDelta(name="lookup", arguments=""))
    for fast, delta in zip(piece.delta_json(), pydantic_deltas(piece), strict=True):
        assert ev.delta(fast) == want(delta)
    lp = ChatLogprobs(content=[ChatLogprobEntry(token="a", logprob=-0.5, bytes=[97], top_logprobs=[
        TopLogprobEntry(token="a", logprob=-0.5, bytes=[97])])])
    assert ev.delta(b'{"content":"a"}', None, lp) == want(ChatDelta(content="a"), logprobs=lp)


def test_usage_events_and_completion_body() -> None:
    usage = UsageCounts(prompt_tokens=5, completion_tokens=2, cached_tokens=4)
    with_reasoning = UsageCounts(5, 2, 4, reasoning_tokens=1)
    assert usage_model(usage) == Usage(prompt_tokens=5, completion_tokens=2, total_tokens=7,
                                  prompt_tokens_details=PromptTokensDetails(cached_tokens=4))
    assert usage_model(with_reasoning).completion_tokens_details == CompletionTokensDetails(
        reasoning_tokens=1)
    for u in (usage, with_reasoning, UsageCounts(0, 0, 0, 0)):
        assert usage_json(u) == usage_model(u).model_dump_json().encode()
        assert CompletionEvents("c", 1, "m").usage(u) == sse(
            CompletionChunk(id="c", created=1, model="m", choices=[], usage=usage_model(u)))
        assert ChatEvents("c", 1, "m").usage(u) == sse(
            ChatCompletionChunk(id="c", created=1, model="m", choices=[], usage=usage_model(u)))
    lp = CompletionLogprobs(tokens=["a"], token_logprobs=[-0.25], top_logprobs=[{"a": -0.25}],
                            text_offset=[0])
    for logprobs in (None, lp):
        want = CompletionResponse(id="cmpl-9", created=11, model="tiny", usage=usage_model(usage),
                                  choices=[
            CompletionChoice(text="héllo\n\"x\"", finish_reason="length", logprobs=logprobs)])
        got = completion_body("cmpl-9", 11, "tiny", "héllo\n\"x\"", "length", logprobs, usage)
        assert got == want.model_dump_json().encode()
    chunk = CompletionChunk(id="c", created=1, model="m", choices=[
        CompletionChoice(text="a", logprobs=lp)])
    assert CompletionEvents("c", 1, "m").text("a", None, lp) == sse(chunk)


CALLS = st.one_of(st.none(), st.lists(st.tuples(TEXT, TEXT, TEXT), min_size=1, max_size=3))
LOGPROBS = ChatLogprobs(content=[ChatLogprobEntry(token="a", logprob=-0.5, bytes=[97],
                                                  top_logprobs=[])])


@settings(max_examples=300, deadline=None)
@given(content=st.one_of(st.none(), TEXT), reasoning=st.one_of(st.none(), TEXT), calls=CALLS,
       reason=REASON, logprobs=st.sampled_from([None, LOGPROBS]),
       reasoning_tokens=st.one_of(st.none(), st.integers(0, 9)))
def test_chat_body_bytes(content: str | None, reasoning: str | None,
                         calls: list[tuple[str, str, str]] | None, reason: str | None,
                         logprobs: ChatLogprobs | None, reasoning_tokens: int | None) -> None:
    tool_calls = None if calls is None else [
        ToolCall(id=i, function=FunctionCall(name=n, arguments=a)) for i, n, a in calls]
    usage = UsageCounts(7, 3, 2, reasoning_tokens)
    want = ChatCompletionResponse(id="chatcmpl-x", created=5, model="m", usage=usage_model(usage),
                                  choices=[ChatChoice(message=ChatMessageOut(
                                      content=content, reasoning_content=reasoning,
                                      tool_calls=tool_calls), logprobs=logprobs,
                                      finish_reason=reason)])
    got = chat_body("chatcmpl-x", 5, "m", content, reasoning, tool_calls, logprobs, reason, usage)
    assert got == want.model_dump_json().encode()


def test_return_token_ids_fields() -> None:
    """return_token_ids: the choice's ids, and the prompt's on the body / the first chunk."""
    for ids, prompt in ((None, None), ([5, 6], None), ([5], [1, 2, 3])):
        chunk = CompletionChunk(id="c", created=1, model="m", choices=[
            CompletionChoice(text="x", finish_reason="stop", token_ids=ids,
                             prompt_token_ids=prompt)])
        assert CompletionEvents("c", 1, "m").text("x", "stop", None, ids, prompt) == sse(chunk)
        body = CompletionResponse(id="c", created=1, model="m", choices=[
            CompletionChoice(text="x", finish_reason="stop", token_ids=ids,
                             prompt_token_ids=prompt)])
        got = completion_body("c", 1, "m", "x", "stop", None, None, ids, prompt)
        assert got == body.model_dump_json().encode()
