"""The OpenAI HTTP API as pydantic models: requests (validated) and responses (serialized).

Requests accept the OpenAI fields plus the vLLM/SGLang extensions (top_k, min_p, ignore_eos,
min_tokens, stop_token_ids, skip_special_tokens, repetition_penalty, chat_template_kwargs,
guided_*, structured_outputs). Unknown fields are refused: OpenAI itself answers 400
"Unrecognized request argument supplied", and a field we silently ignored would look honoured
to the client (a dropped `tools` or `response_format` gives plain text with a 200). Fields
OpenAI defines that Tandem does not implement are declared and refused by name in
`check_sampling` / `check_unsupported`. Value ranges are checked there so the error can name
the field; wrong types are pydantic's errors, mapped to 400 by the app.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

from gateway.agent_types import ResponseFormat, StructuredOutputs, Tool, ToolChoice
from gateway.errors import BadRequest


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    include_obfuscation: bool | None = None  # only false/absent: no obfuscation padding is sent


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="forbid")

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
    logit_bias: dict[str, float] | None = None  # token id (as a JSON key) -> bias in [-100, 100]
    # Metadata the API accepts and that changes nothing about the output: nothing to honour.
    user: str | None = None
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # a routing hint; cache_aware routing reads the prompt
    store: bool | None = None  # only false/absent: nothing is stored
    service_tier: str | None = None  # only "auto" / "default": there is one tier
    # Structured output: OpenAI's response_format, vLLM / SGLang's guided_* and the newer
    # structured_outputs object. At most one of them (or a forced tool call) per request.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # only "xgrammar" (the engine the workers run)
    structured_outputs: StructuredOutputs | None = None
    # vLLM / SGLang extensions
    top_k: int = -1
    min_p: float = 0.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    repetition_penalty: float = 1.0

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """OpenAI's nullable fields (`n`, `stream`, `presence_penalty`, `echo`, ...): null is
        the default, as if left out; the openai client sends null for a keyword given as None.
        A required field (`prompt`, `messages`) keeps its null, and its 400."""
        if isinstance(data, dict) and None in data.values():
            drop = _defaulted_fields(cls)
            return {k: v for k, v in data.items() if v is not None or k not in drop}
        return data

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def max_tokens_field(self) -> str:
        """The field `requested_max_tokens` came from (errors name what the client sent)."""
        return "max_tokens"

    def default_max_tokens(self) -> int | None:
        """max_tokens when the request leaves it out; None: what fits in max_model_len."""
        return None

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def num_top_logprobs(self) -> int:
        """How many alternatives per token to return; -1 when logprobs are off."""
        return -1


@functools.cache
def _defaulted_fields(cls: type[BaseModel]) -> frozenset[str]:
    """The fields of a request model whose default is a value (not None, not required)."""
    return frozenset(name for name, f in cls.model_fields.items()
                     if not f.is_required() and f.default is not None)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None  # refused unless empty: no fill-in-the-middle
    best_of: int | None = None  # refused unless 1
    # vLLM's: each choice (each stream chunk) carries its output `token_ids`, the first one the
    # `prompt_token_ids`. Always on for a model served without a tokenizer (token-id mode).
    return_token_ids: bool = False

    def num_top_logprobs(self) -> int:
        return -1 if self.logprobs is None else self.logprobs

    def default_max_tokens(self) -> int | None:
        """16, OpenAI's default for /v1/completions (vLLM's and SGLang's too); chat's is what
        fits, as vLLM's. Capped at what fits after the prompt."""
        return 16


class ContentPart(BaseModel):
    """One part of a message's content. Every part type parses (image_url, input_audio, file
    carry fields of their own), so that `ChatMessage.text` refuses what is not text by its type
    rather than a union error naming neither."""

    model_config = ConfigDict(extra="allow")
    type: str  # required, as OpenAI has it: a part of no type is not guessed to be text
    text: str | None = None  # required in a text part (checked by `ChatMessage.text`)


# Fields the openai client derives from a response message and sends back with it when the
# message is fed back as history (its parse and stream helpers return them): copies of what
# the message says, accepted as OpenAI and vLLM accept them, never given to the template.
CLIENT_ECHOES: dict[str, bool | set[str]] = {"index": True, "function": {"parsed_arguments"}}


class HistoryFunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str | dict[str, Any] = "{}"  # JSON text (OpenAI); a mapping is accepted too
    # The openai client's parse/stream helpers add `arguments` parsed; sent back, it repeats
    # `arguments` and is not read (see CLIENT_ECHOES).
    parsed_arguments: Any = None


class HistoryToolCall(BaseModel):
    """A tool call of an earlier assistant turn, as the client sends it back."""

    model_config = ConfigDict(extra="forbid")
    id: str | None = None
    type: Literal["function"] = "function"
    function: HistoryFunctionCall
    index: int | None = None  # a streamed call's position, kept by the client: not read


Role = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[HistoryToolCall] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call this result answers
    reasoning_content: str | None = None  # an earlier turn's reasoning (templates may show it)
    reasoning: str | None = None  # the same, under the name some clients use
    # What a client echoes back from an OpenAI response message; empty values only.
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None
    function_call: Any = None
    parsed: Any = None  # the parse/stream helpers' copy of `content` as an object: not read

    def text(self, where: str = "message") -> str | None:
        """The content as one string (text parts joined); None when absent. `where` names the
        message in errors."""
        if not isinstance(self.content, list):
            return self.content
        texts = []
        for j, part in enumerate(self.content):
            if part.type != "text":
                raise BadRequest(f"message content part type {part.type!r} is not supported: "
                                 "this model reads text only; send text parts",
                                 param="messages", code="unsupported_parameter")
            if part.model_extra:
                raise BadRequest(f"text content part: unrecognized field "
                                 f"{next(iter(part.model_extra))!r}; remove it",
                                 param="messages", code="unknown_parameter")
            if part.text is None:
                raise BadRequest(f"{where}.content[{j}].text is required in a text part; send "
                                 "the text (it may be empty)", param="messages")
            texts.append(part.text)
        return "".join(texts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM / SGLang: false renders no opening of the assistant's turn; continue_final_message
    # (with it false) leaves the last message open for the model to go on (assistant prefill).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    reasoning_effort: str | None = None  # passed to the chat template (gpt-oss reads it)
    # Declared so the error can say what they are; refused when set (check_unsupported).
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None
    verbosity: str | None = None

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def named_tool(self) -> str | None:
        """The function `tool_choice` names (`{"type": "function", ...}`); None for a mode."""
        choice = self.tool_choice
        return None if choice is None or isinstance(choice, str) else choice.function.name

    def num_top_logprobs(self) -> int:
        if not self.logprobs:
            return -1
        return self.top_logprobs or 0


INT32_MAX = 2**31 - 1  # the wire's int32 fields (max_tokens, top_k, token ids)
FLOAT32_MAX = 3.4028234663852886e38  # the wire's float fields: past it a value reads as inf
MAX_N = 128  # choices per request: OpenAI's bound (each choice is a worker request)
# Stop strings per request. Every one is searched at every token of every choice on the
# gateway's event loop, so the count bounds that work; OpenAI and TGI allow 4, vLLM no bound.
MAX_STOP = 64
# A repetition penalty divides the positive logits of repeated tokens: past 1e-30 or so (1e-39,
# a float32 denormal) they overflow to inf and the worker's softmax gives NaN (a 502, a null
# logprob). No penalty anyone means is near the bound.
MIN_REPETITION_PENALTY = 1e-6

# Chat fields OpenAI defines that Tandem does not implement: name -> the way forward.
_UNSUPPORTED_CHAT = {
    "functions": "functions is deprecated and not supported; send tools",
    "function_call": "function_call is deprecated and not supported; send tool_choice",
    "audio": "audio output is not supported; this gateway serves text",
    "prediction": "predicted outputs are not supported; omit prediction",
    "web_search_options": "web search is not supported; omit web_search_options",
    "verbosity": "verbosity is not supported; omit it (ask for brevity in the prompt)",
}


def check_unsupported(req: _SamplingFields) -> None:
    """Refuse, by name, fields the API defines and Tandem does not honour."""
    if isinstance(req, ChatCompletionRequest):
        for name, why in _UNSUPPORTED_CHAT.items():
            if getattr(req, name) is not None:
                raise BadRequest(why, param=name, code="unsupported_parameter")
        if req.modalities is not None and req.modalities != ["text"]:
            raise BadRequest(f"modalities {json.dumps(req.modalities)} is not supported; "
                             'send ["text"]',
                             param="modalities", code="unsupported_parameter")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise BadRequest("suffix (fill-in-the-middle) is not supported; omit it",
                             param="suffix", code="unsupported_parameter")
        if req.best_of is not None and req.best_of != req.n:  # best_of == n picks nothing
            raise BadRequest(f"best_of={req.best_of} is not supported (choices are not ranked "
                             f"server-side); send best_of equal to n ({req.n}) or omit it",
                             param="best_of", code="unsupported_parameter")
    if req.store:
        raise BadRequest("store=true is not supported: nothing is stored; omit it",
                         param="store", code="unsupported_parameter")
    if req.service_tier not in (None, "auto", "default"):
        raise BadRequest(f"service_tier {req.service_tier!r} is not supported; send \"auto\"",
                         param="service_tier", code="unsupported_parameter")
    so = req.stream_options
    if so is not None and not req.stream:  # OpenAI's rule too: it would change nothing
        raise BadRequest("stream_options is only allowed with stream=true; omit it or stream",
                         param="stream_options", code="invalid_value")
    if so is not None and so.include_obfuscation:
        raise BadRequest("stream_options.include_obfuscation is not supported; omit it",
                         param="stream_options", code="unsupported_parameter")
    if req.guided_decoding_backend not in (None, "xgrammar"):
        raise BadRequest(f"guided_decoding_backend {req.guided_decoding_backend!r} is not "
                         "available; the workers run xgrammar", param="guided_decoding_backend",
                         code="unsupported_parameter")


def logit_bias_ids(req: _SamplingFields, vocab_size: int) -> dict[int, float]:
    """`logit_bias` as {token id: bias}, checked: ids in the vocabulary, bias in [-100, 100]."""
    out: dict[int, float] = {}
    for key, bias in (req.logit_bias or {}).items():
        try:
            tid = int(key)
        except ValueError:
            raise BadRequest(f"logit_bias key {key!r} is not a token id; keys are token ids "
                             "as strings", param="logit_bias") from None
        if not 0 <= tid < vocab_size:
            raise BadRequest(f"logit_bias: token id {tid} is outside the vocabulary "
                             f"[0, {vocab_size})", param="logit_bias")
        if not math.isfinite(bias) or not -100 <= bias <= 100:
            raise BadRequest(f"logit_bias for token {tid} must be in [-100, 100], got {bias}",
                             param="logit_bias")
        out[tid] = bias
    return out


def check_sampling(req: _SamplingFields) -> None:
    """Reject values the OpenAI API rejects; raise `BadRequest` naming the field."""
    check_unsupported(req)
    if isinstance(req, CompletionRequest) and req.echo:
        raise BadRequest("echo is not supported; send echo=false (the prompt is in your "
                         "request)", param="echo")
    if req.n < 1:
        raise BadRequest(f"n must be >= 1, got {req.n}", param="n")
    if req.n > MAX_N:
        raise BadRequest(f"n must be <= {MAX_N}, got {req.n}", param="n")
    if isinstance(req.stop, list) and len(req.stop) > MAX_STOP:
        raise BadRequest(f"stop takes at most {MAX_STOP} strings, got {len(req.stop)}",
                         param="stop")
    if req.stop == "" or (isinstance(req.stop, list) and "" in req.stop):
        raise BadRequest("stop cannot contain an empty string (it would match at once); leave "
                         "it out or send [] for no stop strings", param="stop")
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty"):
        v = getattr(req, name)
        if v is not None and not math.isfinite(v):  # JSON's NaN / Infinity literals parse so
            raise BadRequest(f"{name} must be a finite number, got {v}", param=name)
        if v is not None and abs(v) > FLOAT32_MAX:
            raise BadRequest(f"{name} must be at most {FLOAT32_MAX:.6g}, got {v}", param=name)
    mt = req.requested_max_tokens()
    mt_name = req.max_tokens_field()
    if mt is not None and mt <= 0:
        raise BadRequest(f"{mt_name} must be >= 1, got {mt}", param=mt_name)
    if mt is not None and mt > INT32_MAX:
        raise BadRequest(f"{mt_name} must be <= {INT32_MAX}, got {mt}", param=mt_name)
    if req.top_k > INT32_MAX:
        raise BadRequest(f"top_k must be <= {INT32_MAX} (or -1 for off), got {req.top_k}",
                         param="top_k")
    if req.temperature is not None and req.temperature < 0:
        raise BadRequest(f"temperature must be >= 0, got {req.temperature}", param="temperature")
    if req.top_p is not None and not 0 < req.top_p <= 1:
        raise BadRequest(f"top_p must be in (0, 1], got {req.top_p}", param="top_p")
    if req.top_k < -1:
        raise BadRequest(f"top_k must be -1 (off) or >= 0, got {req.top_k}", param="top_k")
    if not 0 <= req.min_p <= 1:
        raise BadRequest(f"min_p must be in [0, 1], got {req.min_p}", param="min_p")
    if not 0 <= req.min_tokens <= INT32_MAX:
        raise BadRequest(f"min_tokens must be in [0, {INT32_MAX}], got {req.min_tokens}",
                         param="min_tokens")
    if mt is not None and req.min_tokens > mt:
        raise BadRequest(f"min_tokens ({req.min_tokens}) must be <= {mt_name} ({mt})",
                         param="min_tokens")
    if req.repetition_penalty < MIN_REPETITION_PENALTY:
        raise BadRequest(f"repetition_penalty must be >= {MIN_REPETITION_PENALTY:g} (1 = off), "
                         f"got {req.repetition_penalty}", param="repetition_penalty")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(req, name)
        if not -2 <= v <= 2:
            raise BadRequest(f"{name} must be in [-2, 2], got {v}", param=name)
    if isinstance(req, CompletionRequest) and req.logprobs is not None and req.logprobs < 0:
        # -1 read as "off" would drop the field (vLLM reads it as the whole vocabulary)
        raise BadRequest(f"logprobs must be in [0, 20] (or null for none), got {req.logprobs}",
                         param="logprobs")
    top = req.num_top_logprobs()
    chat_top = req.top_logprobs if isinstance(req, ChatCompletionRequest) else None
    if top > 20:
        raise BadRequest(f"at most 20 top logprobs are supported, got {top}",
                         param="logprobs" if chat_top is None else "top_logprobs")
    if top < -1 or (chat_top is not None and chat_top < 0):
        raise BadRequest("top_logprobs must be >= 0", param="top_logprobs")
    if chat_top and top < 0:  # OpenAI's rule: alternatives come only with the logprobs
        raise BadRequest("top_logprobs needs logprobs=true", param="top_logprobs")
