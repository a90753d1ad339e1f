"""`n` > 1: one request, n choices, each choice its own worker request sharing the prompt.

Fan-out (`start_choices`):
 1. Choice 0 is dispatched as any request is (gateway/dispatch.py: a mono worker or a PD pair,
    one retry before its first token). Its first token means the prompt has been computed and
    its pages sit in the prefix cache of the worker that computed it (the mono worker, or the
    pair's prefill worker).
 2. Choices 1..n-1 are then dispatched together, each preferring that worker (`prefer`, unless
    it is unhealthy or a retry excludes it), so their prefills hit the prompt's pages and
    compute only its last, partial page. Under PD each choice is its own prefill/decode pair:
    its own room and its own decode seat (a decode worker's pages are per request; the decode
    worker is picked per choice, by load), which spreads the n decodes over the decode pool.
 3. The response starts once every choice has its first token, so a choice that fails before
    it fails the request with its own status (an OpenAI-shaped error) and the others' worker
    requests are aborted.

Each choice's worker request id is "<request id>-<i>" (Abort names it); with a `seed`, choice i
samples with seed + i (mod 2**64, vLLM's rule): the same request gives the same n choices.

A /v1/completions request with a list of prompts (a batch, as OpenAI and vLLM take it) has n
choices for each: prompt p's choice j is choice p * n + j, seeded seed + j (vLLM seeds each
prompt's choices alike). Step 1 dispatches every prompt's first choice at once, step 2 the
rest of each prompt's choices to the worker that computed that prompt. Usage counts each
prompt once (and the cached tokens of each prompt's first choice).

After the first tokens every choice has what an n = 1 request has: its own assembler (stop
strings, logprobs, token ids), for chat its own parsers (reasoning, tool calls), and, streamed,
its own events with its `index`. Usage counts the prompt once (cached tokens: choice 0's, the
choice that computed it) and sums the completion tokens of all choices. A choice that ends on
a stop string is aborted on its workers at once. Not streamed, a choice a worker's fault cuts
past its first token runs again on a new pair, as an n = 1 answer does (`Answer.read`); one
that fails for good fails the request (streamed: an error event, then `[DONE]`) and every other
choice is aborted; so is every choice when the client leaves. n = 1 never comes here: its
path (gateway/serving.py) is unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Iterable
from typing import Any, TypeVar

from starlette.responses import Response

from gateway.agents import ChatPlan
from gateway.chunks import chat_choice, choices_body, completion_choice
from gateway.dispatch import RequestRun
from gateway.dispatcher import Dispatcher
from gateway.errors import ApiError
from gateway.metrics import Metrics, TokenClock
from gateway.openai_responses import UsageCounts
from gateway.output import NO_FINISH, Answer, Assemblers, assemblers_for
from gateway.pool import Worker
from gateway.session import Output
from gateway.sse import SSEResponse
from gateway.streaming import StreamEvents
from gateway.tokenizer import Tokenizer
from protocol import tandem_pb2

log = logging.getLogger(__name__)
_T = TypeVar("_T")
_DONE = b"data: [DONE]\n\n"
_JSON = "application/json"


def choice_sampling(sampling: tandem_pb2.SamplingParams, index: int
                    ) -> tandem_pb2.SamplingParams:
    """Choice `index`'s sampling: the request's, its seed (if any) + index mod 2**64."""
    out = tandem_pb2.SamplingParams()
    out.CopyFrom(sampling)
    if sampling.HasField("seed"):
        out.seed = (sampling.seed + index) % 2**64
    return out


Prompt = tuple[list[int], tandem_pb2.SamplingParams]  # a prompt's ids and its sampling


async def start_choices(d: Dispatcher, request_id: str, prompts: list[Prompt], n: int
                        ) -> list[tuple[RequestRun, Output]]:
    """Every choice's run with its first output, in choice order (steps 1-3 of the module's
    docstring). Any failure, or the caller's cancellation, aborts and closes every run
    started."""
    def run(p: int, j: int, prefer: Worker | None = None) -> RequestRun:
        ids, sampling = prompts[p]
        return RequestRun(d, f"{request_id}-{p * n + j}", ids, choice_sampling(sampling, j),
                          prefer)

    leaders = [run(p, 0) for p in range(len(prompts))]
    runs = list(leaders)
    try:
        firsts = await _all(r.first() for r in leaders)
        rest = [run(p, j, leaders[p].prompt_worker)
                for p in range(len(prompts)) for j in range(1, n)]
        runs += rest
        rest_firsts = await _all(r.first() for r in rest)
    except BaseException:
        for r in runs:
            r.abort()
            r.close()
        raise
    started = []
    for p in range(len(prompts)):  # in choice order: each prompt's first, then its others
        k = p * (n - 1)
        started.append((leaders[p], firsts[p]))
        started += zip(rest[k:k + n - 1], rest_firsts[k:k + n - 1], strict=True)
    return started


async def _all(aws: Iterable[Awaitable[_T]]) -> list[_T]:
    """Every awaitable's result, run at once; at the first error (or a cancellation) the rest
    are cancelled and waited for, so that nothing of theirs runs on after the caller."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    if not tasks:
        return []
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.wait(tasks)


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


class Choice(Answer):
    """One choice's run and output (`parts`: completions' text, not streamed)."""

    __slots__ = ("index", "run", "first", "events", "clock")

    def __init__(self, index: int, run: RequestRun, first: Output, make: Assemblers,
                 clock: TokenClock) -> None:
        super().__init__(make)
        self.index = index
        self.run = run
        self.first = first
        self.clock = clock
        self.events: StreamEvents | None = None  # streamed


class ChoicesResponse:
    """The response of an n > 1 request whose choices all have their first token."""

    def __init__(self, started: list[tuple[RequestRun, Output]], req: Any, plan: ChatPlan | None,
                 tok: Tokenizer, metrics: Metrics, model_name: str, request_id: str,
                 prompts: list[list[int]], t0: float,
                 eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.req = req
        self.metrics = metrics
        self.model_name = model_name
        self.request_id = request_id
        self.t0 = t0
        self.chat = plan is not None
        self.created = int(time.time())
        n = req.n  # choices a prompt
        makes = [assemblers_for(tok, req, plan, ids, eos_token_ids) for ids in prompts]
        self.choices = [Choice(i, run, first, makes[i // n],
                               TokenClock(metrics.itl, len(first.token_ids)))
                        for i, (run, first) in enumerate(started)]
        self.leaders = self.choices[::n]  # each prompt's first choice

    async def respond(self, headers: dict[str, str]) -> Response:
        if not self.req.stream:
            return await self._complete(headers)
        for c in self.choices:
            c.events = StreamEvents(self.request_id, self.model_name, c.out, c.chat_out,
                                    c.clock, c.index, self.created)
        return SSEResponse(self._stream(), headers, on_abandon=lambda: self._end("aborted"))

    # ---- not streamed ----

    async def _complete(self, headers: dict[str, str]) -> Response:
        outcome = "aborted"  # stays so if the request is cancelled (client gone, shutdown)
        try:
            await _all(self._read_to_end(c) for c in self.choices)
            outcome = "success"
        except ApiError as err:
            outcome = err.outcome
            log.log(err.log_level, "request %s failed: %s", self.request_id, err.message)
            return err.response(headers)
        except Exception:
            outcome = "server_error"
            raise
        finally:
            self._end(outcome)
        body = choices_body(("chatcmpl-" if self.chat else "cmpl-") + self.request_id,
                            "chat.completion" if self.chat else "text_completion", self.created,
                            self.model_name, [self._choice_json(c) for c in self.choices],
                            self._usage())
        return Response(body, media_type=_JSON, headers=headers)

    async def _read_to_end(self, c: Choice) -> None:
        await c.read(c.run, c.first, c.clock)  # run again on a worker's fault (Answer.read)
        await self._choice_ended(c)

    def _choice_json(self, c: Choice) -> bytes:
        out = c.out
        if c.chat_out is None:
            lp_c = out.completion_logprobs(out.logprobs) if out.want_logprobs else None
            ids = out.return_token_ids
            return completion_choice(c.index, "".join(c.parts), out.finish_reason, lp_c,
                                     out.token_ids if ids else None,
                                     out.prompt_ids if ids else None)
        chat_out = c.chat_out
        lp = out.chat_logprobs(out.logprobs) if out.want_logprobs else None
        return chat_choice(c.index, chat_out.message_content(), chat_out.message_reasoning(),
                           chat_out.calls or None, lp, chat_out.finish_reason(out.finish_reason))

    # ---- streamed ----

    async def _stream(self) -> AsyncIterator[bytes]:
        outcome = "aborted"  # what is left if the client goes away mid-stream
        reads: dict[asyncio.Future[Output | None], Choice] = {}
        try:
            for c in self.choices:
                assert c.events is not None
                for event in c.events.opening():
                    yield event
            for c in self.choices:
                assert c.events is not None
                events = c.events.of(c.first)
                if events:
                    yield b"".join(events)
                self._read_next(c, reads)
            while reads:  # each choice's outputs in order, the choices interleaved as they come
                done, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    c = reads.pop(fut)
                    msg = fut.result()  # a choice's error fails the request
                    if msg is None:
                        raise ApiError(NO_FINISH, status=502)
                    assert c.events is not None
                    c.events.arrived(msg)
                    events = c.events.of(msg)
                    if events:
                        yield b"".join(events)
                    self._read_next(c, reads)
            await _all(c.run.settle() for c in self.choices if not c.out.stopped_by_string)
            if self.req.include_usage():
                assert self.choices[0].events is not None
                yield self.choices[0].events.usage(self._usage())
            outcome = "success"
            yield _DONE
        except ApiError as err:
            outcome = err.outcome
            log.log(err.log_level, "request %s failed mid-stream: %s", self.request_id,
                    err.message)
            yield b"data: " + err.json_bytes() + b"\n\n"
            yield _DONE
        except Exception:
            outcome = "server_error"
            log.exception("request %s: unexpected error mid-stream", self.request_id)
            err_body = ApiError("internal gateway error; see the gateway log").json_bytes()
            yield b"data: " + err_body + b"\n\n"
            yield _DONE
        finally:
            for fut in reads:
                fut.cancel()
            self._end(outcome)

    def _read_next(self, c: Choice, reads: dict[asyncio.Future[Output | None], Choice]) -> None:
        """Start the choice's next read; a finished choice stopped by a stop string is aborted
        on its workers now (the others settle once all are done)."""
        if not c.out.finished:
            read = asyncio.ensure_future(c.run.next())
            read.add_done_callback(_retrieve)  # a second choice's error, after the first's
            reads[read] = c
        elif c.out.stopped_by_string:
            c.run.abort()

    # ---- every choice ----

    async def _choice_ended(self, c: Choice) -> None:
        """The choice's output is complete: a stop string's ends on its workers now (the other
        choices go on); a finished one reads its stream's end and the prefill leg's."""
        if c.out.stopped_by_string:
            c.run.abort()
        else:
            await c.run.settle()

    def _usage(self) -> UsageCounts:
        reasoning = [c.chat_out.reasoning_tokens for c in self.choices
                     if c.chat_out is not None and c.chat_out.has_reasoning_parser]
        return UsageCounts(self._prompt_tokens(),
                           sum(c.out.completion_tokens for c in self.choices),
                           self._cached_tokens(), sum(reasoning) if reasoning else None)

    def _prompt_tokens(self) -> int:
        return sum(c.out.num_prompt_tokens for c in self.leaders)

    def _cached_tokens(self) -> int:
        return sum(c.run.num_cached_tokens for c in self.leaders)

    def _end(self, outcome: str) -> None:
        """Every choice's worker requests end (aborted unless it finished by itself); the
        request counts once in the metrics."""
        for c in self.choices:
            if outcome != "success":
                c.run.abort()
            c.run.close()
        self.metrics.request_ended(outcome, self.t0, self._prompt_tokens(),
                                   sum(c.out.completion_tokens for c in self.choices),
                                   self._cached_tokens())
