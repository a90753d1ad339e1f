"""Turn a worker's token stream into OpenAI text, finish reasons, usage and logprobs.

One `OutputAssembler` per request: `add(msg)` feeds a `GenerateResponse` and returns the text
that may be sent now (detokenized incrementally, cut at a stop string, with a possible stop
prefix held back); `add_token_pieces(msg)` returns it one piece per token, with the text
released at the end that is no token's own kept apart, for parsers that count tokens.
Special tokens that a parser reads (`keep_token_ids`: a `[TOOL_CALLS]` marker, say) keep their
text even when `skip_special_tokens` drops the others.

`Answer` reads a non-streamed answer to its end; the client sees none of it before then, so a
worker's fault past the first output runs the request again (`restart`) into fresh assemblers
(`assemblers_for`, the one place a request's fields become its assemblers).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from gateway.agents import ChatPlan
from gateway.chat_output import ChatOutput
from gateway.detokenize import IncrementalDetokenizer, StopStringMatcher
from gateway.errors import ApiError, WorkerCallError
from gateway.metrics import TokenClock
from gateway.openai_responses import (
    ChatLogprobEntry,
    ChatLogprobs,
    CompletionLogprobs,
    TopLogprobEntry,
    UsageCounts,
)
from gateway.session import Output
from gateway.token_bytes import TextOffsets, token_text
from gateway.tokenizer import Tokenizer
from protocol import tandem_pb2


class OutputAssembler:
    """Text, finish reason, counts and logprobs of one request's output."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool,
                 stops: list[str], num_top_logprobs: int,
                 keep_token_ids: frozenset[int] = frozenset(),
                 stop_token_ids: frozenset[int] = frozenset(), min_tokens: int = 0) -> None:
        self._tok = tokenizer
        # Ids whose token ends the output without its text (eos, stop_token_ids), as vLLM's
        # and SGLang's: counted in usage, token_ids and logprobs. A parser's marker keeps it.
        self._stop_ids = stop_token_ids - keep_token_ids
        self.prompt_ids = prompt_ids
        self.num_prompt_tokens = len(prompt_ids)  # usage: every prompt token the worker read
        # Completions with return_token_ids, or token-id mode: choices carry token_ids.
        self.return_token_ids = False
        # Special tokens dropped before detokenizing, when some must keep their text.
        self._drop: frozenset[int] = frozenset()
        if skip_special_tokens and keep_token_ids:
            self._drop = tokenizer.special_ids - keep_token_ids
            skip_special_tokens = False
            prompt_ids = [t for t in prompt_ids if t not in self._drop]
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens, prompt_ids)
        self._stop = StopStringMatcher(stops) if stops else None
        # Stop strings are not checked within the first min_tokens tokens (vLLM's and SGLang's
        # rule, as for the stop ids the worker bans that long): none may end in those tokens.
        self._min_tokens = min_tokens
        # Text with no stop string to watch and no id to drop: a message's text is the
        # detokenizer's delta for its ids, as it is (`add`'s common case, every streamed token).
        self.plain = self._stop is None and not self._drop and tokenizer.has_text
        self.want_logprobs = num_top_logprobs >= 0
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.stopped_by_string = False
        self.logprobs: list[tandem_pb2.TokenLogprob] = []  # all of them (non-streaming responses)
        self.token_ids: list[int] = []  # every output id (return_token_ids, token-id mode)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, msg: Output) -> str:
        """Feed one worker message; return the text that may be sent to the client now."""
        if self.plain and not msg.finish_reason:
            self._count(msg)
            return self._detok.step(msg.token_ids)
        pieces, tail = self.add_token_pieces(msg, per_token=False)
        return "".join(pieces) + tail

    def _count(self, msg: Output) -> None:
        """The message's tokens (and logprobs, when asked) into the output's."""
        self.completion_tokens += len(msg.token_ids)
        if self.want_logprobs:
            self.logprobs.extend(msg.logprobs)
        self.token_ids.extend(msg.token_ids)

    def add_token_pieces(self, msg: Output, per_token: bool = True) -> tuple[list[str], str]:
        """Feed one worker message; its tokens' text as pieces (one per token with
        `per_token`), and the tail: text released as the output ends that no token of this
        message brought (what the detokenizer or a stop string held back), which a parser
        counting tokens must not count (a message can end the output with no token at all)."""
        self._count(msg)
        if not self._tok.has_text:  # token-id mode: ids only, no text to cut or stop on
            if msg.finish_reason:
                self.finish_reason = msg.finish_reason
            return [], ""
        # ids: the tokens detokenized; at[i]: where ids[i] stands in the message
        at = [j for j, t in enumerate(msg.token_ids) if t not in self._drop] if self._drop else None
        ids = [msg.token_ids[j] for j in at] if at is not None else msg.token_ids
        # the stop token that ended the output: a piece with no text
        end = int(msg.finish_reason == "stop" and bool(ids) and ids[-1] in self._stop_ids
                  and ids[-1] == msg.token_ids[-1])
        if per_token or self._stop is not None:  # a stop string ends the output at its token
            pieces = [self._detok.step((t,)) for t in ids[:len(ids) - end]] + [""] * end
        else:
            pieces = [self._detok.step(ids[:len(ids) - end])] if len(ids) > end else []
        n_tok = len(pieces)  # pieces past these are the tail
        if msg.finish_reason:
            pieces.append(self._detok.flush())
        if self._stop is not None:
            cut: list[str] = []
            # pieces[i] is the text of the output's token number before + (its index) + 1
            before = self.completion_tokens - len(msg.token_ids)
            for i, p in enumerate(pieces):
                pos = self.completion_tokens if i >= len(ids) else \
                    before + 1 + (at[i] if at is not None else i)
                cut.append(self._stop.feed(p, pos > self._min_tokens))
                if self._stop.stopped:
                    if i < len(ids):  # tokens after it in the message are not output
                        self._trim(len(msg.token_ids) - 1 - (at[i] if at is not None else i))
                    self.stop_early()
                    return cut[:n_tok], "".join(cut[n_tok:])
            if msg.finish_reason:
                cut.append(self._stop.flush())
            pieces = cut
        if msg.finish_reason:
            self.finish_reason = msg.finish_reason
        return pieces[:n_tok], "".join(pieces[n_tok:])

    def _trim(self, excess: int) -> None:
        """A stop string ended `excess` tokens before the message did: those tokens are not
        part of the output (usage, token_ids, logprobs), as when the worker sends one token a
        message and the gateway stops it at the stop string's."""
        if excess > 0:
            self.completion_tokens -= excess
            del self.token_ids[-excess:]
            if self.want_logprobs:
                del self.logprobs[-excess:]

    def stop_early(self) -> None:
        """The gateway ends the output here (a stop string, or a parser's rule): the worker
        is aborted and the finish reason is "stop"."""
        self.stopped_by_string = True
        self.finish_reason = "stop"

    def usage(self, cached_tokens: int, reasoning_tokens: int | None = None) -> UsageCounts:
        """`reasoning_tokens`: None when no reasoning parser ran (the detail is left out)."""
        return UsageCounts(self.num_prompt_tokens, self.completion_tokens, cached_tokens,
                           reasoning_tokens)

    # ---- logprobs in the two OpenAI shapes ----

    def _token(self, token_id: int) -> tuple[str, bytes]:
        """A logprob's token and bytes (gateway/token_bytes.py; token_id:N in token-id mode)."""
        data = self._tok.token_bytes(token_id)
        return (token_text(data) if self._tok.has_text else self._tok.id_to_token(token_id)), data

    def completion_logprobs(self, entries: Any,
                            offsets: TextOffsets | None = None) -> CompletionLogprobs:
        """`offsets`: the stream's count of text so far (a fresh one for a whole answer)."""
        out = CompletionLogprobs(top_logprobs=[])
        offsets = TextOffsets() if offsets is None else offsets
        for e in entries:
            t, data = self._token(e.token_id)
            out.tokens.append(t)
            out.token_logprobs.append(e.logprob)
            out.text_offset.append(offsets.advance(data))
            assert out.top_logprobs is not None
            top = {self._token(a.token_id)[0]: a.logprob for a in e.top}
            # OpenAI's legacy logprobs (and vLLM's): the k likeliest and always the sampled
            # token, so up to k + 1 entries; chat's top_logprobs are the k likeliest only.
            top.setdefault(t, e.logprob)
            out.top_logprobs.append(top)
        return out

    def chat_logprobs(self, entries: Any) -> ChatLogprobs:
        content = []
        for e in entries:
            t, data = self._token(e.token_id)
            top = []
            for a in e.top:
                a_t, a_data = self._token(a.token_id)
                top.append(TopLogprobEntry(token=a_t, logprob=a.logprob, bytes=list(a_data)))
            content.append(ChatLogprobEntry(token=t, logprob=e.logprob, bytes=list(data),
                                            top_logprobs=top))
        return ChatLogprobs(content=content)


NO_FINISH = "the worker's stream ended without a finish_reason"


async def read_to_end(next_output: Callable[[], Awaitable[Output | None]], first: Output,
                      out: OutputAssembler, chat_out: ChatOutput | None,
                      clock: TokenClock) -> list[str]:
    """A run's outputs from `first` on (each later one read with `next_output`) into `out`
    until it finishes; the chat API's go on into `chat_out` (finished at the end), the
    completions API's text pieces are returned. A stream that ends unfinished is a 502."""
    parts: list[str] = []
    msg: Output | None = first
    while msg is not None:
        if chat_out is None:
            parts.append(out.add(msg))
        else:
            chat_out.feed(*out.add_token_pieces(msg, chat_out.per_token))
            if chat_out.stop_now:
                out.stop_early()
        if out.finished:
            break
        msg = await next_output()
        if msg is not None:
            clock.arrived(len(msg.token_ids))
    if not out.finished:
        raise ApiError(NO_FINISH, status=502)
    if chat_out is not None:
        chat_out.finish()
    return parts


Assemblers = Callable[[], tuple[OutputAssembler, ChatOutput | None]]


def assemblers_for(tok: Tokenizer, req: Any, plan: ChatPlan | None, prompt_ids: list[int],
                   eos_token_ids: frozenset[int] = frozenset()) -> Assemblers:
    """A request's (or a choice's) assemblers from its fields, new on each call (a chat
    request has a plan; a completion may return token ids). `eos_token_ids`: the workers'."""
    stop_ids = (frozenset() if req.ignore_eos else eos_token_ids) | frozenset(
        req.stop_token_ids or ())

    def make() -> tuple[OutputAssembler, ChatOutput | None]:
        out = OutputAssembler(tok, prompt_ids, req.skip_special_tokens, req.stop_strings(),
                              req.num_top_logprobs(),
                              plan.keep_token_ids if plan is not None else frozenset(), stop_ids,
                              req.min_tokens)
        out.return_token_ids = plan is None and (req.return_token_ids or not tok.has_text)
        return out, ChatOutput(plan) if plan is not None else None
    return make


class Rerun(Protocol):
    """What `Answer.read` needs of a run (gateway/dispatch.py `RequestRun`)."""

    async def next(self) -> Output | None: ...

    async def restart(self, err: WorkerCallError) -> Output: ...


class Answer:
    """A non-streamed answer: its assemblers and, for completions, its text pieces."""

    __slots__ = ("_make", "out", "chat_out", "parts")

    def __init__(self, make: Assemblers) -> None:
        self._make = make
        self.out, self.chat_out = make()
        self.parts: list[str] = []

    async def read(self, run: Rerun, first: Output, clock: TokenClock) -> None:
        """The run's outputs from `first` to the end (`read_to_end`). A worker's fault past the
        first output runs the request again into fresh assemblers (`run.restart`, which raises
        the fault when the request's one retry is spent or off)."""
        while True:
            try:
                self.parts = await read_to_end(run.next, first, self.out, self.chat_out, clock)
                return
            except WorkerCallError as err:
                first = await run.restart(err)
                self.out, self.chat_out = self._make()
