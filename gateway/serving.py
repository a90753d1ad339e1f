"""Serving one OpenAI generation request: parse, validate, dispatch, respond.

`GenerationHandler.handle(request, chat)` is the whole path for /v1/completions and
/v1/chat/completions: read the body (size-capped) and validate it into the pydantic request
(gateway/request_body.py), build the prompt ids (chat template or tokenizer), check lengths
against the workers' max_model_len, build SamplingParams, dispatch, and answer as JSON or
SSE. Errors before the first token become an OpenAI-shaped error with its real status code;
after it (streaming) an SSE `error` event followed by `[DONE]`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from gateway.agents import ChatPlan, Parsers, plan_chat
from gateway.chat_output import ChatOutput
from gateway.choices import ChoicesResponse, Prompt, start_choices
from gateway.chunks import chat_body, completion_body
from gateway.dispatch import RequestRun
from gateway.dispatcher import Dispatcher
from gateway.errors import ApiError, BadRequest, NotFound, refused_constraint
from gateway.metrics import Metrics, TokenClock
from gateway.openai_types import (
    MAX_N,
    ChatCompletionRequest,
    CompletionRequest,
    check_sampling,
    logit_bias_ids,
)
from gateway.output import NO_FINISH, Answer, Assemblers, OutputAssembler, assemblers_for
from gateway.request_body import BodyBudget, parse_request, raw_header, read_body
from gateway.session import Output
from gateway.sse import DisconnectWatcher, SSEResponse
from gateway.streaming import StreamEvents
from gateway.structured import request_constraint
from gateway.tokenizer import Tokenizer
from protocol import tandem_pb2
from protocol.sampling import GREEDY_BELOW

log = logging.getLogger(__name__)


def _log_failure(err: ApiError, fmt: str, request_id: str) -> None:
    """A failed request, once, at its error's level (5xx WARNING, 4xx DEBUG)."""
    log.log(err.log_level, fmt, request_id, err.message)


# A body past this is planned (parsed, templated, tokenized) on a thread (`_plan`)
OFF_LOOP_BYTES = 64 << 10


class _Planned(NamedTuple):
    req: Any  # ChatCompletionRequest | CompletionRequest
    plan: ChatPlan | None  # chat only
    prompts: list[list[int]]  # each prompt's ids (a completions batch: several)
    samplings: list[tandem_pb2.SamplingParams]  # one a prompt
    source: str  # the request field of its output constraint ("" = none)


_DONE = b"data: [DONE]\n\n"
_JSON = "application/json"


class GenerationHandler:
    """Shared state for the two generation endpoints (no per-request state kept here)."""

    def __init__(self, tokenizer: Tokenizer, dispatcher: Dispatcher, metrics: Metrics,
                 model_name: str, max_model_len: int, vocab_size: int, max_request_bytes: int,
                 body_timeout_s: float = 30.0, parsers: Parsers | None = None,
                 sampling_defaults: dict[str, float] | None = None,
                 eos_token_ids: frozenset[int] = frozenset(),
                 body_budget: BodyBudget | None = None) -> None:
        self.tok = tokenizer
        self.eos_token_ids = eos_token_ids  # the workers' (GetInfo): an output's end, not text
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.model_name = model_name
        # min over workers (a prompt must fit on both legs); 0 = unknown
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_request_bytes = max_request_bytes
        self.body_timeout_s = body_timeout_s
        self.body_budget = body_budget  # the gateway's, shared by the handlers it builds
        self.parsers = parsers or Parsers()
        # generation_config.json's values for the sampling fields a request leaves out
        # (gateway/sampling_defaults.py); empty: the API's defaults
        self.sampling_defaults = sampling_defaults or {}
        # Request ids without the client's: this process's random prefix and a counter (unique
        # across gateways with overwhelming odds; uuid4 costs a getrandom call per request).
        self._id_prefix = secrets.token_hex(8)
        self._id_count = itertools.count()

    def _new_id(self) -> str:
        return f"{self._id_prefix}{next(self._id_count):08x}"

    async def handle(self, request: Request, chat: bool) -> Response:
        t0 = time.perf_counter()
        # A client's X-Request-Id names the response (its id, the header echoed, as vLLM's)
        # and leads the id the workers see, which stays unique: two requests sent with the
        # same header shared their attempt ids, so the workers' abort of one (its client
        # left, a stop string) ended the other too.
        client_id = raw_header(request, b"x-request-id")
        run_id = f"{client_id}-{self._new_id()}" if client_id else self._new_id()
        request_id = client_id or run_id
        headers = {"x-request-id": request_id}
        try:
            body = await read_body(request, self.max_request_bytes, self.body_timeout_s,
                                   self.body_budget)
        except ApiError as err:
            self.metrics.requests.labels(err.outcome).inc()
            return err.response(headers)
        except ClientDisconnect:  # nothing started on the workers; not an error of ours
            self.metrics.requests.labels("aborted").inc()
            log.debug("request %s: client left before its body was complete", request_id)
            return Response(status_code=499)
        watcher = DisconnectWatcher(request.receive)
        try:
            response = await self._handle(body, chat, t0, request_id, run_id, headers)
        except asyncio.CancelledError:
            watcher.stop()
            if not watcher.fired:
                raise
            watcher.absorb()  # the client left: the request was aborted on the workers already
            log.debug("request %s: client disconnected", request_id)
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        except BaseException:
            watcher.stop()
            raise
        if isinstance(response, SSEResponse):
            response.watcher = watcher  # the same task sends the stream: one watcher for all
        else:
            watcher.stop()
        return response

    async def _handle(self, body: bytes, chat: bool, t0: float, request_id: str, run_id: str,
                      headers: dict[str, str]) -> Response:
        """`request_id` names the response; `run_id` (unique) the workers' requests."""
        source = ""  # the request field of its output constraint, if any
        try:
            # A large body's parse, template and tokenizing take a thread, not the event loop:
            # a 2 MB prompt held every other client's stream for ~0.7 s on the dev box.
            planned = await asyncio.to_thread(self._plan, body, chat) \
                if len(body) > OFF_LOOP_BYTES else self._plan(body, chat)
            req, plan, prompts, samplings, source = planned
            if req.n > 1 or len(prompts) > 1:  # n choices a prompt (gateway/choices.py)
                started = await self._start_choices(
                    run_id, list(zip(prompts, samplings, strict=True)), req.n)
                self.metrics.ttft.observe(time.perf_counter() - t0)
                return await ChoicesResponse(started, req, plan, self.tok, self.metrics,
                                             self.model_name, request_id, prompts, t0,
                                             self.eos_token_ids).respond(headers)
            (prompt_ids,), (sampling,) = prompts, samplings
            run = RequestRun(self.dispatcher, run_id, prompt_ids, sampling)
            try:
                first = await run.first()
            except BaseException as exc:
                run.abort()  # client gone before the first token: the workers stop too
                run.close()
                if isinstance(exc, asyncio.CancelledError):
                    self.metrics.requests.labels("aborted").inc()
                raise
        except ApiError as err:
            err = refused_constraint(err, source)
            outcome = err.outcome
            self.metrics.requests.labels(outcome).inc()
            _log_failure(err, "request %s failed: %s", request_id)
            return err.response(headers)
        self.metrics.ttft.observe(time.perf_counter() - t0)
        assemblers = assemblers_for(self.tok, req, plan, prompt_ids, self.eos_token_ids)
        if req.stream:
            out, chat_out = assemblers()
            stream = StreamEvents(request_id, self.model_name, out, chat_out,
                                  TokenClock(self.metrics.itl, len(first.token_ids)))
            gen = self._stream(run, first, out, chat_out, stream, req.include_usage(), request_id,
                               t0)
            return SSEResponse(gen, headers, on_abandon=lambda: self._abandon(run, out, t0),
                               on_direct=stream.attach)
        return await self._complete(run, first, assemblers, request_id, t0, headers)

    def _plan(self, body: bytes, chat: bool) -> _Planned:
        """The request, its prompts' ids and their sampling (ApiError: a 4xx); thread-safe."""
        plan: ChatPlan | None = None
        req = parse_request(body, ChatCompletionRequest if chat else CompletionRequest)
        check_sampling(req)
        if req.model is not None and req.model != self.model_name:
            raise NotFound(f"model {req.model!r} does not exist; this gateway serves "
                           f"{self.model_name!r}", code="model_not_found", param="model")
        if not self.tok.has_text:
            self._check_token_id_mode(req, chat)
        if chat:
            plan = plan_chat(req, self.tok, self.parsers)
            prompts, structured = [plan.prompt_ids], plan.structured
            source = plan.constraint_source
        else:
            prompts = self._prompts(req)
            constraint = request_constraint(req)
            structured = None if constraint is None else constraint.to_proto([])
            source = "" if constraint is None else constraint.source
        samplings = [self._sampling(req, len(ids)) for ids in prompts]
        if structured is not None:
            for sampling in samplings:
                sampling.structured.CopyFrom(structured)
        return _Planned(req, plan, prompts, samplings, source)

    async def _start_choices(self, request_id: str, prompts: list[Prompt], n: int
                             ) -> list[tuple[RequestRun, Output]]:
        try:
            return await start_choices(self.dispatcher, request_id, prompts, n)
        except asyncio.CancelledError:
            self.metrics.requests.labels("aborted").inc()
            raise

    # ---- request → prompt ids and sampling ----

    def _check_token_id_mode(self, req: Any, chat: bool) -> None:
        """A model without a tokenizer: token-id prompts on /v1/completions; a field that needs
        text is a 400 naming it (never silently dropped)."""
        if chat:
            self.tok.render_chat([])  # raises the 400 that says to send token ids
        if req.stop_strings():
            raise BadRequest("stop: this model has no tokenizer, so stop strings cannot be "
                             "matched; use stop_token_ids", param="stop", code="no_tokenizer")

    def _prompts(self, req: CompletionRequest) -> list[list[int]]:
        """The prompt's ids; a batch (a list of strings or of id lists): each prompt's."""
        prompt = req.prompt
        if not (isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))):
            return [self._prompt_ids(prompt)]  # type: ignore[arg-type]
        if len(prompt) * req.n > MAX_N:
            raise BadRequest(f"{len(prompt)} prompts of n={req.n} choices are "
                             f"{len(prompt) * req.n} choices; at most {MAX_N} a request",
                             param="prompt")
        return [self._prompt_ids(p) for p in prompt]

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tok.encode(prompt)
        else:
            ids = list(prompt)  # type: ignore[arg-type]
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise BadRequest(f"prompt token id {bad} is outside the vocabulary "
                                 f"[0, {self.vocab_size})", param="prompt")
        if not ids:
            raise BadRequest("prompt is empty", param="prompt")
        return ids

    def _sampling(self, req: Any, num_prompt_tokens: int) -> tandem_pb2.SamplingParams:
        max_tokens = req.requested_max_tokens()
        default = req.default_max_tokens()
        limit = self.max_model_len
        if limit:
            if num_prompt_tokens >= limit:
                chat = isinstance(req, ChatCompletionRequest)  # the field the prompt came from
                raise BadRequest(f"prompt has {num_prompt_tokens} tokens; max_model_len is "
                                 f"{limit}, which leaves no room for output; shorten the "
                                 f"{'messages' if chat else 'prompt'}",
                                 param="messages" if chat else "prompt",
                                 code="context_length_exceeded")
            if max_tokens is None:  # the default, capped to what fits
                fits = limit - num_prompt_tokens
                max_tokens = fits if default is None else min(default, fits)
            elif num_prompt_tokens + max_tokens > limit:
                field = req.max_tokens_field()  # the one the client sent
                raise BadRequest(f"prompt ({num_prompt_tokens} tokens) + {field} "
                                 f"({max_tokens}) exceeds max_model_len ({limit}); lower "
                                 f"{field} or shorten the prompt", param=field,
                                 code="context_length_exceeded")
        elif max_tokens is None:
            max_tokens = 16 if default is None else default
        if req.min_tokens > max_tokens:  # max_tokens was left out: the default, or what fits
            why = (f"what fits in max_model_len ({limit}) after the prompt's "
                   f"{num_prompt_tokens} tokens" if limit and max_tokens != default
                   else "the default")
            raise BadRequest(f"min_tokens ({req.min_tokens}) must be <= max_tokens, which is "
                             f"{max_tokens} when left out ({why}); lower min_tokens",
                             param="min_tokens")
        vocab = self.vocab_size
        bad_stop = next((t for t in req.stop_token_ids or () if not 0 <= t < vocab), None)
        if bad_stop is not None:
            raise BadRequest(f"stop_token_ids: {bad_stop} is outside the vocabulary "
                             f"[0, {vocab})", param="stop_token_ids")
        seed = req.seed
        if seed is not None:  # OpenAI's range is int64's (vLLM's too); ids up to 2**64 also fit
            if not -(2**63) <= seed < 2**64:
                raise BadRequest(f"seed must be in [-2**63, 2**64), got {seed}", param="seed")
            seed &= 2**64 - 1  # the wire's uint64: a negative seed as its two's complement
        top = req.num_top_logprobs()
        bias = logit_bias_ids(req, vocab)
        params = tandem_pb2.SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_k=max(req.top_k, 0), top_p=1.0 if req.top_p is None else req.top_p,
            min_p=req.min_p, seed=seed, max_tokens=max_tokens, min_tokens=req.min_tokens,
            stop_token_ids=req.stop_token_ids or (), ignore_eos=req.ignore_eos,
            top_logprobs=max(top, 0), logprobs=top >= 0,
            repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty)
        if self.sampling_defaults:  # the model's, for what the request left out (or null)
            sent = req.model_fields_set
            for name, value in self.sampling_defaults.items():
                if name not in sent or getattr(req, name) is None:
                    setattr(params, name, max(int(value), 0) if name == "top_k" else value)
        if 0 < params.temperature < GREEDY_BELOW:
            params.temperature = 0.0
        if bias:  # an empty map through the constructor costs 1 µs a request (upb)
            params.logit_bias.update(bias)
        return params

    # ---- responses ----

    def _account(self, outcome: str, out: OutputAssembler, run: RequestRun, t0: float) -> None:
        self.metrics.request_ended(outcome, t0, out.num_prompt_tokens, out.completion_tokens,
                                   run.num_cached_tokens)

    def _abandon(self, run: RequestRun, out: OutputAssembler, t0: float) -> None:
        """The client left before the stream's body started: end the request like a
        disconnect."""
        run.abort()
        run.close()
        self._account("aborted", out, run, t0)

    async def _complete(self, run: RequestRun, first: Output, assemblers: Assemblers,
                        request_id: str, t0: float, headers: dict[str, str]) -> Response:
        """A JSON answer (`Answer.read`: run again on a worker's fault past its first token)."""
        answer = Answer(assemblers)
        outcome = "aborted"  # stays so if the request is cancelled (server shutdown)
        try:
            await answer.read(run, first, TokenClock(self.metrics.itl, len(first.token_ids)))
            await run.settle()
            outcome = "success"
        except ApiError as err:
            outcome = err.outcome
            _log_failure(err, "request %s failed: %s", request_id)
            return err.response(headers)
        except Exception:
            outcome = "server_error"
            raise
        finally:
            if answer.out.stopped_by_string or outcome != "success":
                run.abort()
            run.close()
            self._account(outcome, answer.out, run, t0)
        out, chat_out, parts = answer.out, answer.chat_out, answer.parts
        created = int(time.time())
        if chat_out is None:  # bytes straight from the parts (gateway/chunks.py), as for chat
            logprobs_c = out.completion_logprobs(out.logprobs) if out.want_logprobs else None
            ids = out.return_token_ids
            body = completion_body(f"cmpl-{request_id}", created, self.model_name, "".join(parts),
                                   out.finish_reason, logprobs_c, out.usage(run.num_cached_tokens),
                                   out.token_ids if ids else None, out.prompt_ids if ids else None)
            return Response(body, media_type=_JSON, headers=headers)
        usage = out.usage(run.num_cached_tokens, chat_out.reasoning_tokens
                          if chat_out.has_reasoning_parser else None)
        logprobs = out.chat_logprobs(out.logprobs) if out.want_logprobs else None
        body = chat_body(f"chatcmpl-{request_id}", created, self.model_name,
                         chat_out.message_content(), chat_out.message_reasoning(),
                         chat_out.calls or None, logprobs,
                         chat_out.finish_reason(out.finish_reason), usage)
        return Response(body, media_type=_JSON, headers=headers)

    async def _stream(self, run: RequestRun, first: Output, out: OutputAssembler,
                      chat_out: ChatOutput | None, stream: StreamEvents, include_usage: bool,
                      request_id: str, t0: float) -> AsyncIterator[bytes]:
        outcome = "aborted"  # what is left if the client goes away mid-stream
        try:
            for event in stream.opening():
                yield event
            msg: Output | None = first
            while msg is not None:
                for event in stream.of(msg):
                    yield event
                if out.finished:
                    break
                if stream.direct is not None:  # what the sink refuses comes back here
                    run.push(stream.sink)
                msg = await run.next()
                if msg is not None:
                    stream.arrived(msg)
            if not out.finished:
                raise ApiError(NO_FINISH, status=502)
            await run.settle()
            if include_usage:
                reasoning = (chat_out.reasoning_tokens if chat_out is not None
                             and chat_out.has_reasoning_parser else None)
                yield stream.usage(out.usage(run.num_cached_tokens, reasoning))
            outcome = "success"
            yield _DONE
        except ApiError as err:
            outcome = err.outcome
            _log_failure(err, "request %s failed mid-stream: %s", request_id)
            yield b"data: " + err.json_bytes() + b"\n\n"
            yield _DONE
        except Exception:
            outcome = "server_error"
            log.exception("request %s: unexpected error mid-stream", request_id)
            err_body = ApiError("internal gateway error; see the gateway log").json_bytes()
            yield b"data: " + err_body + b"\n\n"
            yield _DONE
        finally:
            if out.stopped_by_string or outcome != "success":
                run.abort()
            run.close()
            self._account(outcome, out, run, t0)
