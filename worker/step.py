"""What passes between the three calls of an engine step.

    plan = scheduler.schedule()        # SchedulePlan: who runs, how many tokens each
    out = runner.run(plan)             # RunOutput: one sampled token per sampling chunk
    scheduler.update(plan, out)        # append, stop checks, finish

Plain dataclasses in a module of their own, so the scheduler, the runner and the CUDA-graph
code share them without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.request import Request, RequestStatus, TokenLogprob

PENDING = -1  # an output slot whose token is still on the device (overlapped decode)


@dataclass
class ScheduledChunk:
    """One request's share of a step."""

    request: Request
    start: int  # position of the first token computed this step (= num_computed_tokens)
    num_tokens: int  # tokens computed this step
    sample: bool  # the chunk reaches the request's last known token: sample the next one
    # The request's window ring (hybrid models): where its window layers keep their last W rows.
    window_pages: list[int] = field(default_factory=list)
    window_from: int = 0  # first position the ring holds valid rows for (bounded replay's start)
    full_from: int = 0  # positions below keep their cached full-page KV: not written again
    state_slot: int = -1  # its recurrent-state slot (models with linear-attention layers)
    # Speculative decoding: a decode chunk reserves room for up to max_drafts draft tokens; the
    # drafter fills `drafts` after scheduling (num_tokens grows by their number), the verify
    # step scores the request's last token and its drafts in one forward.
    max_drafts: int = 0
    drafts: list[int] = field(default_factory=list)

    def input_ids(self) -> list[int]:
        """The tokens this chunk feeds: its span of the request's tokens, then its drafts."""
        n = self.num_tokens - len(self.drafts)
        return self.request.all_token_ids()[self.start : self.start + n] + self.drafts

    @property
    def num_logits(self) -> int:
        """Rows of logits the chunk needs: none, its last token's, or one per draft + 1."""
        return (1 + len(self.drafts)) if self.sample else 0


@dataclass
class SchedulePlan:
    """What `runner.run` executes; `update` reads it back."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    num_tokens: int = 0  # sum of chunk lengths: the step's token count
    # Recurrent-state slot copies (src slot, or -1 = zeros; dst slot) to apply before the
    # forward: new requests start from zeros or from a prefix snapshot, snapshots are taken.
    state_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.chunks

    def drop_finished(self) -> None:
        """Take out chunks of requests that ended since the plan was made (overlapped decode)."""
        self.chunks = [c for c in self.chunks if c.request.status is RequestStatus.RUNNING]
        self.num_tokens = sum(c.num_tokens for c in self.chunks)


@dataclass
class RunOutput:
    """The runner's answer: one entry per chunk with `sample=True`, in plan order."""

    token_ids: list[int]  # each sampling chunk's first new token
    logprobs: list[TokenLogprob | None]
    # Speculative decoding: the further tokens a verify step emitted (accepted drafts after the
    # first, then the correction or bonus token); [] per chunk otherwise. None = no chunk had any.
    more_token_ids: list[list[int]] | None = None
