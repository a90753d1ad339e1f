"""A request inside the engine, and its lifecycle."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from protocol.errors import PEER_TIMEOUT
from transfer.room import Side
from worker.sampling import SamplingParams

if TYPE_CHECKING:  # worker/grammar_xgr.py imports xgrammar: only workers that get a grammar load it
    from worker.grammar_xgr import RequestGrammar


class RequestStatus(enum.Enum):
    """Where a request is. Finished states last (`is_finished`)."""

    WAITING = enum.auto()  # queued for (re)computation of its tokens
    WAITING_FOR_REMOTE_KV = enum.auto()  # decode role: pages reserved, KV in flight from prefill
    RUNNING = enum.auto()  # in the running batch (prefill chunks or decoding)
    TRANSFERRING = enum.auto()  # prefill role: prompt done, pages being shipped to decode
    FINISHED_STOPPED = enum.auto()  # eos or a stop token id
    FINISHED_LENGTH = enum.auto()  # max_tokens or the context limit
    FINISHED_ABORTED = enum.auto()  # the client or the gateway aborted it
    FINISHED_ERROR = enum.auto()  # failed; `error` says why (reaches the client)

    @property
    def is_finished(self) -> bool:
        return self.value >= RequestStatus.FINISHED_STOPPED.value


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class DraftState:
    """Where a request's model drafter stands between steps (worker/spec/drafter.py).

    The drafter's KV is computed for positions below `position`; a request is ready to draft
    when that is every token but its last (`position == num_tokens - 1`). eagle / mtp also keep
    their output feature at `position - 1`, the hidden input (and logits) of the first draft.
    A decode worker's request gets it from prefill (the room's DONE event)."""

    position: int
    feature: torch.Tensor | None = None  # [hidden] in the model dtype; None for a draft model


# An entity: compared and hashed by identity (lists of them are searched every step).
@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    room: int = 0  # PD rendezvous id (0 in monolithic mode)
    bootstrap_addr: str = ""  # PD: the prefill worker's bootstrap service
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in this request's pages
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (first admission)
    page_table: list[int] = field(default_factory=list)  # pages holding this request's KV, in order
    num_preemptions: int = 0
    error: str = ""
    # How the error maps to a status: invalid | unavailable | deadline | peer | internal.
    error_code: str = ""
    arrival_time: float = field(default_factory=time.monotonic)
    generator: torch.Generator | None = None  # per-request seeded sampling
    grammar: RequestGrammar | None = None  # its matcher (sampling.structured); closed at finish
    transfer_stats: dict[str, float] | None = None  # PD: pages, bytes, duration_ms of its room
    draft: DraftState | None = None  # speculative decoding's model drafter, between steps

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: what must be in the KV cache to sample the next one."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def finish_reason(self) -> str:
        return FINISH_REASONS.get(self.status, "")


def room_error_code(error: str, fault: Side | None = None, mine: Side | None = None,
                    timed_out: bool = False) -> str:
    """The status class of a failed room, from who failed it (`fault`, the room's own verdict;
    `mine`: this worker's side). "peer" (ABORTED) when the other side did: the gateway blames
    that worker and retries elsewhere; "peer_timeout" (ABORTED too) when it also stopped
    answering in time: the gateway marks it suspect as well. This side's own fault: prefill
    late with the prompt is "deadline"; decode timed out means prefill could not reach it in
    time (its transfer agent does not answer, or it never registered): "unavailable", which
    marks it suspect; a write that failed without a timeout is "internal" (blamed, not
    suspect: it still answers). Without a verdict (an older peer): a deadline, else the peer."""
    if fault is None or mine is None:
        return "deadline" if "deadline" in error or "timed out" in error else "peer"
    if fault is not mine:
        return PEER_TIMEOUT if timed_out else "peer"
    if not timed_out:
        return "internal"  # a write into this side failed: blame it, but it still answers
    return "deadline" if mine is Side.PREFILL else "unavailable"
