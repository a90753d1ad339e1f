"""The OpenAI HTTP API as pydantic models: requests (validated) and responses (serialized).

Requests accept the OpenAI fields plus the vLLM/SGLang sampling extensions (top_k, min_p,
ignore_eos, min_tokens, stop_token_ids, skip_special_tokens, repetition_penalty). Unknown
fields are ignored, as OpenAI does. Value ranges are checked in `check_sampling` so the
error can name the field; wrong types are pydantic's errors, mapped to 400 by the app.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from gateway.errors import BadRequest


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # vLLM / SGLang extensions
    top_k: int = -1
    min_p: float = 0.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    repetition_penalty: float = 1.0

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return [s for s in stops if s]

    def num_top_logprobs(self) -> int:
        """How many alternatives per token to return; -1 when logprobs are off."""
        return -1


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False

    def num_top_logprobs(self) -> int:
        return -1 if self.logprobs is None else self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str = "text"
    text: str = ""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool_calls, name, ... pass through to the template
    role: str
    content: str | list[TextPart] | None = None

    def as_template_dict(self) -> dict[str, Any]:
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):  # OpenAI content parts: only text is understood here
            for part in self.content:
                if part.type != "text":
                    raise BadRequest(f"message content part type {part.type!r} is not supported; send text parts",
                                     param="messages")
            d["content"] = "".join(p.text for p in self.content)
        return d


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_top_logprobs(self) -> int:
        if not self.logprobs:
            return -1
        return self.top_logprobs or 0


INT32_MAX = 2**31 - 1  # the wire's int32 fields (max_tokens, top_k, token ids)


def check_sampling(req: _SamplingFields) -> None:
    """Reject values the OpenAI API rejects; raise `BadRequest` naming the field."""
    if isinstance(req, CompletionRequest) and req.echo:
        raise BadRequest("echo is not supported; send echo=false (the prompt is in your request)", param="echo")
    if req.n != 1:
        raise BadRequest("n>1 is not supported; send n=1 (or omit it) and repeat the request", param="n")
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        v = getattr(req, name)
        if v is not None and not math.isfinite(v):  # JSON's NaN / Infinity literals parse to these
            raise BadRequest(f"{name} must be a finite number, got {v}", param=name)
    mt = req.requested_max_tokens()
    if mt is not None and mt <= 0:
        raise BadRequest(f"max_tokens must be >= 1, got {mt}", param="max_tokens")
    if mt is not None and mt > INT32_MAX:
        raise BadRequest(f"max_tokens must be <= {INT32_MAX}, got {mt}", param="max_tokens")
    if req.top_k > INT32_MAX:
        raise BadRequest(f"top_k must be <= {INT32_MAX} (or -1 for off), got {req.top_k}", param="top_k")
    if req.temperature is not None and req.temperature < 0:
        raise BadRequest(f"temperature must be >= 0, got {req.temperature}", param="temperature")
    if req.top_p is not None and not 0 < req.top_p <= 1:
        raise BadRequest(f"top_p must be in (0, 1], got {req.top_p}", param="top_p")
    if req.top_k < -1:
        raise BadRequest(f"top_k must be -1 (off) or >= 0, got {req.top_k}", param="top_k")
    if not 0 <= req.min_p <= 1:
        raise BadRequest(f"min_p must be in [0, 1], got {req.min_p}", param="min_p")
    if req.min_tokens < 0:
        raise BadRequest(f"min_tokens must be >= 0, got {req.min_tokens}", param="min_tokens")
    if mt is not None and req.min_tokens > mt:
        raise BadRequest(f"min_tokens ({req.min_tokens}) must be <= max_tokens ({mt})", param="min_tokens")
    if req.repetition_penalty <= 0:
        raise BadRequest(f"repetition_penalty must be > 0, got {req.repetition_penalty}", param="repetition_penalty")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(req, name)
        if not -2 <= v <= 2:
            raise BadRequest(f"{name} must be in [-2, 2], got {v}", param=name)
    top = req.num_top_logprobs()
    if top > 20:
        raise BadRequest(f"at most 20 top logprobs are supported, got {top}", param="logprobs")
    if top < -1 or (isinstance(req, ChatCompletionRequest) and req.top_logprobs is not None and req.top_logprobs < 0):
        raise BadRequest("top_logprobs must be >= 0", param="top_logprobs")


# ---- responses -----------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


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
    content: str


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
    role: str | None = None
    content: str | None = None


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
