"""Turn a worker's token stream into OpenAI text, finish reasons, usage and logprobs.

One `OutputAssembler` per request: `add(msg)` feeds a `GenerateResponse` and returns the text
that may be sent now (detokenized incrementally, cut at a stop string, with a possible stop
prefix held back); `flush()` releases held-back text at the end.
"""

from __future__ import annotations

from typing import Any

from gateway.detokenize import IncrementalDetokenizer, StopStringMatcher
from gateway.metrics import Metrics
from gateway.openai_types import (
    ChatLogprobEntry,
    ChatLogprobs,
    CompletionLogprobs,
    PromptTokensDetails,
    TopLogprobEntry,
    Usage,
)
from gateway.tokenizer import Tokenizer
from protocol import tandem_pb2


class OutputAssembler:
    """Text, finish reason, counts and logprobs of one request's output."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool,
                 stops: list[str], num_top_logprobs: int, metrics: Metrics) -> None:
        self._tok = tokenizer
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens, prompt_ids)
        self._stop = StopStringMatcher(stops) if stops else None
        self._metrics = metrics
        self.want_logprobs = num_top_logprobs >= 0
        self.num_prompt_tokens = len(prompt_ids)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.stopped_by_string = False
        self.logprobs: list[tandem_pb2.TokenLogprob] = []  # all of them (non-streaming responses)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, msg: tandem_pb2.GenerateResponse) -> str:
        """Feed one worker message; return the text that may be sent to the client now."""
        self.completion_tokens += len(msg.token_ids)
        if msg.HasField("transfer") and msg.transfer.bytes:
            self._metrics.observe_transfer(msg.transfer)
        if self.want_logprobs:
            self.logprobs.extend(msg.logprobs)
        text = self._detok.step(msg.token_ids) if msg.token_ids else ""
        if msg.finish_reason:
            text += self._detok.flush()
        if self._stop is not None:
            text = self._stop.feed(text)
            if self._stop.stopped:
                self.stopped_by_string = True
                self.finish_reason = "stop"
                return text
            if msg.finish_reason:
                text += self._stop.flush()
        if msg.finish_reason:
            self.finish_reason = msg.finish_reason
        return text

    def usage(self, cached_tokens: int) -> Usage:
        return Usage(prompt_tokens=self.num_prompt_tokens, completion_tokens=self.completion_tokens,
                     total_tokens=self.num_prompt_tokens + self.completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))

    # ---- logprobs in the two OpenAI shapes ----

    def _text(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)

    def completion_logprobs(self, entries: Any, text_start: int = 0) -> CompletionLogprobs:
        out = CompletionLogprobs(top_logprobs=[])
        offset = text_start
        for e in entries:
            t = self._text(e.token_id)
            out.tokens.append(t)
            out.token_logprobs.append(e.logprob)
            out.text_offset.append(offset)
            offset += len(t)
            assert out.top_logprobs is not None
            out.top_logprobs.append({self._text(a.token_id): a.logprob for a in e.top})
        return out

    def chat_logprobs(self, entries: Any) -> ChatLogprobs:
        content = []
        for e in entries:
            t = self._text(e.token_id)
            content.append(ChatLogprobEntry(
                token=t, logprob=e.logprob, bytes=list(t.encode()),
                top_logprobs=[TopLogprobEntry(token=(a_t := self._text(a.token_id)), logprob=a.logprob,
                                              bytes=list(a_t.encode())) for a in e.top]))
        return ChatLogprobs(content=content)
