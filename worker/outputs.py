"""How outputs leave the engine: once per step, one batch per channel, column by column.

The engine loop does no per-request network work. At the end of every step it groups what its
requests produced by the channel each was submitted on and calls `channel.deliver(batch)` once
per channel that has something (worker/engine.py `_flush`). A channel is one gateway's Session
stream (worker/session.py: one hop to the event loop per step, one protobuf message per step
built from these columns by C-level extends) or, for in-process callers and the legacy
`Generate` call, `PerRequestSink`, which turns the batch back into one `RequestOutput` per
request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from worker.request import TokenLogprob


@dataclass
class RequestOutput:
    """What one request produced since its previous output (per-request callers)."""

    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str = ""  # "" while running; stop | length | abort | error
    error: str = ""
    error_code: str = ""  # invalid | unavailable | deadline | internal (see worker/server.py)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    transfer: dict[str, float] | None = None  # PD: pages, bytes, duration_ms of the room

    @property
    def finished(self) -> bool:
        return bool(self.finish_reason)


@dataclass
class RequestEnded:
    """A request that ended in this step (after its last tokens in the same batch)."""

    tag: int  # the channel's id for the request
    finish_reason: str  # stop | length | abort | error
    error: str = ""
    error_code: str = ""  # "" unless finish_reason is error (see worker/server.py)
    transfer: dict[str, float] | None = None  # PD: pages, bytes, duration_ms of the room


@dataclass
class StepOutputs:
    """One step's outputs for one channel. Columns, so that a front can move them to the wire
    with a handful of list extends however many requests there are."""

    tags: list[int] = field(default_factory=list)  # requests with new tokens, in order
    num_tokens: list[int] = field(default_factory=list)  # per tag: its share of token_ids
    token_ids: list[int] = field(default_factory=list)  # all new tokens, concatenated
    num_logprobs: list[int] = field(default_factory=list)  # per tag: its share of logprobs
    logprobs: list[TokenLogprob] = field(default_factory=list)  # only for requests that asked
    # (tag, num_prompt_tokens, num_cached_tokens) of requests whose first output this is
    started: list[tuple[int, int, int]] = field(default_factory=list)
    ended: list[RequestEnded] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.tags or self.started or self.ended)


class OutputChannel(ABC):
    """Where the outputs of the requests submitted on it go. `deliver` runs on the engine's
    loop thread once per step that produced something for the channel: keep it short (hand
    the batch to another thread or loop; never block, never touch the network here)."""

    @abstractmethod
    def deliver(self, outputs: StepOutputs) -> None:
        """Take one step's batch (the channel owns it from now on)."""


class PerRequestSink(OutputChannel):
    """One request's channel that calls `sink(RequestOutput)` (in-process callers, tests,
    the legacy Generate call): the batch is split back into that request's output."""

    __slots__ = ("request_id", "_sink")

    def __init__(self, request_id: str, sink: Callable[[RequestOutput], None]) -> None:
        self.request_id = request_id
        self._sink = sink

    def deliver(self, outputs: StepOutputs) -> None:
        out = RequestOutput(request_id=self.request_id, token_ids=outputs.token_ids,
                            logprobs=outputs.logprobs)
        if outputs.started:
            _, out.num_prompt_tokens, out.num_cached_tokens = outputs.started[0]
        if outputs.ended:
            end = outputs.ended[0]
            out.finish_reason, out.error = end.finish_reason, end.error
            out.error_code = end.error_code
            out.transfer = end.transfer
        self._sink(out)
