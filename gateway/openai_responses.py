"""The OpenAI HTTP API's response bodies and stream chunks as pydantic models (serialized
with `model_dump_json`; optional fields a chunk does not carry are left out, as OpenAI does)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field

from gateway.agent_types import ToolCall, ToolCallDelta


def _omit_none(value: Any) -> bool:
    return value is None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # output tokens inside the reasoning block


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    # Present when a reasoning parser ran on the request.
    completion_tokens_details: CompletionTokensDetails | None = Field(default=None,
                                                                      exclude_if=_omit_none)


@dataclass(frozen=True, slots=True)
class UsageCounts:
    """A response's usage numbers, which gateway/chunks.py renders as `Usage`'s JSON without
    building it (~5 us a request)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reasoning_tokens: int | None = None  # None: no reasoning parser ran (the detail is left out)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # return_token_ids (or token-id mode): the output ids of this choice / chunk, and the
    # prompt's on the response (the first chunk when streaming).
    token_ids: list[int] | None = Field(default=None, exclude_if=_omit_none)
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_omit_none)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprobEntry(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprobEntry] = []


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobEntry] = []


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None when the turn is only tool calls (as OpenAI sends it)
    reasoning_content: str | None = Field(default=None, exclude_if=_omit_none)
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=_omit_none)


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(BaseModel):
    """A streamed delta: only the fields this chunk carries are sent (OpenAI's shape)."""

    role: str | None = Field(default=None, exclude_if=_omit_none)
    content: str | None = Field(default=None, exclude_if=_omit_none)
    reasoning_content: str | None = Field(default=None, exclude_if=_omit_none)
    tool_calls: list[ToolCallDelta] | None = Field(default=None, exclude_if=_omit_none)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tandem"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
