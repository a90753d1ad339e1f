"""The scheduler: continuous batching with chunked prefill, a prefix cache and preemption.

One engine step is three calls (the objects between them live in worker/step.py):

    plan = scheduler.schedule()        # who runs this step, how many tokens each
    out = runner.run(plan)             # one forward pass + sampling
    scheduler.update(plan, out)        # append tokens, finish, free pages

`schedule` fills a token budget (`chunked_prefill_size`): first the running batch (decodes take
one token, unfinished prompts their next chunk), then waiting requests in arrival order while
the KV cache manager has room, `max_num_seqs` and the budget allow. When pages run out
mid-batch, the newest running request is preempted: its pages go back (through the prefix
cache, so the recompute is cheap) and it waits at the head of the queue to recompute. A
request is never dropped: it finishes or fails with a reason.

Memory is the KV cache manager's (worker/cache_manager.py): the scheduler asks it for room in
requests and tokens and never sees a pool. Hybrid models' window rings, the bounded replay
after a prefix hit, and every later cache-group kind live there.

Roles hook in through `RoleHooks` (worker/prefill.py, worker/decode.py) and call the narrow
role interface at the end of this class (reserve, land, seat, hold, holdings, finish): prefill
ships a request's pages once its prompt is done instead of decoding; decode lands requests
whose KV arrived. Request states change only here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from worker.cache_manager import CacheHold, Holdings, KVCacheManager
from worker.config import SchedulerConfig
from worker.request import Request, RequestStatus, TokenLogprob
from worker.spec.counters import SpecCounters
from worker.spec.eligible import num_drafts, recompute_len
from worker.step import PENDING, RunOutput, ScheduledChunk, SchedulePlan


@dataclass(frozen=True)
class SchedulerStats:
    """One DP group's load, for GetLoad and the engine's group choice."""

    running: int
    waiting: int
    used_pages: int  # held by live requests and holds
    total_pages: int
    cached_pages: int  # evictable prefix-cache pages
    free_pages: int
    window_used_pages: int
    prompt_tokens_computed: int  # prompt tokens this worker ran through the model


class RoleHooks(Protocol):
    """What a role adds around the step (worker/prefill.py, worker/decode.py). Mono has none."""

    def add_request(self, request: Request, scheduler: Scheduler) -> None:
        """A new request arrives, for `scheduler` (its DP group's): prefill opens a room and
        queues it there; decode reserves its memory there first."""
        ...

    def on_prompt_done(self, request: Request) -> bool:
        """The prompt is computed and the first token sampled (called before the stop check).
        True = the role took the request out of the running batch (prefill ships it)."""
        ...

    def poll(self) -> None:
        """Advance the role's own queue (rooms landing or shipping) once per step."""
        ...

    def abort(self, request_id: str, reason: str) -> None:
        """End the request if the role holds it (a room in flight)."""
        ...

    def has_work(self) -> bool:
        """Rooms in flight: the engine keeps polling."""
        ...

    def load_stats(self) -> tuple[dict[str, int], int, int, int]:
        """Rooms by state, transfer bytes and pages so far, requests waiting in the role."""
        ...

    def close(self) -> None: ...


OutputCallback = Callable[[Request], None]


class Scheduler:
    def __init__(
        self,
        scheduler: SchedulerConfig,
        cache: KVCacheManager,
        *,
        max_model_len: int,
        eos_token_ids: Iterable[int],
        on_output: OutputCallback,
        num_speculative_tokens: int = 0,
        spec_counters: SpecCounters | None = None,
    ) -> None:
        self.config = scheduler
        self.cache = cache
        self.page_size = cache.page_size
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.hooks: RoleHooks | None = None  # the role's; the engine polls it once per step
        # Decode: requests holding a seat of the running batch before they run (reserved with
        # their pages, so a landed request never waits for a seat after its first token).
        self._seats: set[Request] = set()
        self._on_output = on_output  # a request has news outside a step's tokens (landed, finished)
        self.num_preemptions = 0
        self.prompt_tokens_computed = 0  # tokens this worker ran that were prompt tokens
        # Drafts per decode step at most (fewer where a window ring spares fewer).
        self.num_speculative_tokens = cache.max_drafts(num_speculative_tokens)
        # A seeded request's drafts a step (fixed, eligible.num_drafts): what fits the step beside
        # every other running request's decode at the same share.
        cap = scheduler.mixed_step_tokens or scheduler.chunked_prefill_size
        self._seeded_drafts = max(0, cap // scheduler.max_num_seqs - 1)
        self.spec_counters = spec_counters or SpecCounters()  # shared by a worker's schedulers
        scheduler.check_window(cache.window_tokens(), self.page_size)

    # ---- intake ------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def abort(self, request_id: str, reason: str = "") -> bool:
        """End a waiting or running request now. Returns whether it was found here."""
        return self.end(request_id, RequestStatus.FINISHED_ABORTED, reason, "unavailable")

    def end(self, request_id: str, status: RequestStatus, error: str = "",
            error_code: str = "internal") -> bool:
        """Take a request out of the queues and finish it with `status`."""
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)  # type: ignore[arg-type]
                    self.finish(req, status, error, error_code)
                    return True
        return False

    # ---- step 1: schedule ---------------------------------------------------------------------
    def schedule(self) -> SchedulePlan:
        plan = SchedulePlan()
        budget = self._step_budget()
        preempted = False
        for req in list(self.running):
            if budget == 0:
                break
            if req not in self.running:  # preempted earlier in this loop to make room
                continue
            n = self._chunk_len(req, budget)
            k = num_drafts(req, self.num_speculative_tokens, n, budget - n, self.max_model_len,
                           self._seeded_drafts)
            if k < 0:  # seeded sampling: its drafts wait for a step with room for all of them
                continue
            while not self.cache.grow(req, req.num_computed_tokens + n + k):
                victim = self._pick_victim(exclude=req, scheduled=plan)
                if victim is None:  # nothing left to preempt but the request itself
                    victim = req
                self._preempt(victim, plan)
                preempted = True
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            self._add_chunk(plan, req, n, k)
            budget -= n + k
        if not preempted:
            self._admit(plan, budget)
        plan.state_copies = self.cache.take_state_copies()
        return plan

    def _step_budget(self) -> int:
        """Tokens this step may carry: `chunked_prefill_size`, or `mixed_step_tokens` while a
        request decodes (each of its decodes waits for the step's prompt chunks)."""
        cap = self.config.mixed_step_tokens  # 0: off, and no scan of the batch
        if cap and any(r.output_token_ids for r in self.running):
            return cap
        return self.config.chunked_prefill_size

    def _chunk_len(self, req: Request, budget: int) -> int:
        """Tokens the request computes this step: what is left, within the budget, ending where
        the cache manager needs a chunk to end (a state group's snapshot point)."""
        left = recompute_len(req, self.num_speculative_tokens)
        return self.cache.chunk_limit(req, min(left, budget))

    def _admit(self, plan: SchedulePlan, budget: int) -> None:
        while (self.waiting and budget > 0
               and len(self.running) + len(self._seats) < self.config.max_num_seqs):
            req = self.waiting[0]
            if not self.cache.fits(req.num_tokens):
                self.waiting.popleft()
                self.finish(req, RequestStatus.FINISHED_ERROR, (
                    f"request needs {req.num_tokens} tokens of KV cache but the worker holds only "
                    f"{self.cache.num_pages * self.page_size}; raise cache.max_total_tokens or "
                    "shorten it"), "invalid")
                continue
            if not req.page_table:
                self._match_prefix(req)
            n = self._chunk_len(req, budget)
            # A recompute's prefix hit may leave only its last token: it decodes, drafts too.
            k = max(0, num_drafts(req, self.num_speculative_tokens, n, budget - n,
                                  self.max_model_len, self._seeded_drafts))
            if not self.cache.admit(req, req.num_computed_tokens + n + k):
                self.cache.free(req)  # give back prefix hits; retry next step
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._add_chunk(plan, req, n, k)
            budget -= n + k

    def _match_prefix(self, req: Request) -> None:
        req.num_computed_tokens = self.cache.match_prefix(req)
        if not req.output_token_ids and req.num_preemptions == 0:
            req.num_cached_tokens = req.num_computed_tokens

    def _add_chunk(self, plan: SchedulePlan, req: Request, n: int, max_drafts: int = 0) -> None:
        start = req.num_computed_tokens
        where = self.cache.chunk_cache(req)
        plan.chunks.append(ScheduledChunk(
            req, start, n, sample=start + n == req.num_tokens, window_pages=where.window_pages,
            window_from=where.window_from, full_from=where.full_from, state_slot=where.state_slot,
            max_drafts=max_drafts,
        ))
        plan.num_tokens += n

    # ---- step 3: update ---------------------------------------------------------------------
    def update(self, plan: SchedulePlan, out: RunOutput) -> None:
        more = iter(out.more_token_ids) if out.more_token_ids is not None else None
        sampled = iter(zip(out.token_ids, out.logprobs, strict=True))
        for chunk in plan.chunks:
            req = chunk.request
            token = logprob = None
            extra: list[int] = []
            if chunk.sample:
                token, logprob = next(sampled)
                extra = next(more) if more is not None else []
            if req.status is not RequestStatus.RUNNING:  # aborted while the step ran
                continue
            if chunk.drafts:
                self._verified(req, chunk, [token, *extra])  # type: ignore[list-item]
                continue
            self._computed(chunk)
            if chunk.max_drafts:  # room was kept for drafts the drafter did not propose
                self.cache.shrink(req, req.num_tokens + 1)
            if token is None:
                continue
            prompt_done = not req.output_token_ids
            req.output_token_ids.append(token)
            if logprob is not None:
                req.output_logprobs.append(logprob)
            if prompt_done:
                self.cache.cache_computed(req)
                # Prefill ships even a request its first token already finished: decode owns
                # the stop decision and must hear about it.
                if self.hooks is not None and self.hooks.on_prompt_done(req):
                    self.running.remove(req)
                    req.status = RequestStatus.TRANSFERRING
                    continue
            status = self.stop_status(req)
            if status is not None:
                self.running.remove(req)
                self.finish(req, status)

    def _computed(self, chunk: ScheduledChunk) -> None:
        """A chunk's tokens have their KV now (or will, once its launched step runs)."""
        req = chunk.request
        req.num_computed_tokens += chunk.num_tokens
        self.cache.computed(req)
        computed = min(req.num_prompt_tokens, req.num_computed_tokens)
        self.prompt_tokens_computed += max(0, computed - chunk.start)

    def _verified(self, req: Request, chunk: ScheduledChunk, tokens: list[int]) -> None:
        """A verify step emitted `tokens` (accepted drafts, then one more): append them up to the
        first that stops the request. The KV of the last token and of each accepted draft is
        valid; the rejected drafts' pages are given back at once."""
        self.spec_counters.record(len(chunk.drafts), len(tokens) - 1)
        for token in tokens:
            req.num_computed_tokens += 1  # the token before this one now has valid KV
            req.output_token_ids.append(token)
            status = self.stop_status(req)
            if status is not None:
                self.running.remove(req)
                self.finish(req, status)
                return
        self.cache.shrink(req, req.num_tokens)

    # ---- overlapped decode (the engine's overlap schedule) ------------------------------------
    def advance(self, plan: SchedulePlan) -> None:
        """A plan was launched and its tokens are not back yet: count each chunk's tokens
        computed and hold the output slot of each that samples with PENDING, so the next plan
        can be scheduled now (its input for the slot is read on the device, worker/runner.py).
        A prompt that ends here enters the prefix cache now (its pages hold only prompt
        tokens); stop checks wait for `complete`. Only plans without drafts, and prompts only
        where no PD role hears of their end (worker/engine.py `_overlappable`)."""
        for chunk in plan.chunks:
            req = chunk.request
            self._computed(chunk)
            if not chunk.sample:
                continue
            prompt_done = not req.output_token_ids
            req.output_token_ids.append(PENDING)
            if prompt_done:
                self.cache.cache_computed(req)

    def complete(self, plan: SchedulePlan, token_ids: list[int]) -> None:
        """An advanced plan's tokens are back (one per chunk that samples): fill each PENDING
        slot, then stop checks. A request that stops here may already sit in the next plan
        (launched): that step's token for it is dropped, and its pages are reused only by work
        queued after that step."""
        sampled = [c for c in plan.chunks if c.sample]
        for chunk, token in zip(sampled, token_ids, strict=True):
            req = chunk.request
            at = chunk.start + chunk.num_tokens - req.num_prompt_tokens  # the output it sampled
            if at >= len(req.output_token_ids) or req.output_token_ids[at] != PENDING:
                continue  # its output was cut (preempted and finished, or stopped a step earlier)
            req.output_token_ids[at] = token
            queue = (self.running if req.status is RequestStatus.RUNNING
                     else self.waiting if req.status is RequestStatus.WAITING else None)
            if queue is None:  # finished meanwhile (aborted)
                continue
            status = self.stop_status(req, at + 1)  # a preempted request (waiting) can stop too
            if status is not None:
                del req.output_token_ids[at + 1 :]  # the slot of the step that over-ran it
                queue.remove(req)  # type: ignore[attr-defined]
                self.finish(req, status)

    def stop_status(self, req: Request, num_out: int | None = None) -> RequestStatus | None:
        """Whether output token `num_out - 1` (default: the last) ends the request."""
        params = req.sampling
        num_out = len(req.output_token_ids) if num_out is None else num_out
        token = req.output_token_ids[num_out - 1]
        eos = not params.ignore_eos and token in self.eos_token_ids
        stopped = token in params.stop_token_ids or eos
        if stopped and num_out >= params.min_tokens:
            return RequestStatus.FINISHED_STOPPED
        if num_out >= params.max_tokens or req.num_prompt_tokens + num_out >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # ---- finishing -------------------------------------------------------------------------------
    def finish(self, req: Request, status: RequestStatus, error: str = "",
               error_code: str = "internal") -> None:
        """End `req`: cache its computed pages, free its memory exactly once, tell the engine."""
        assert not req.status.is_finished, f"{req.request_id} finished twice"
        self._seats.discard(req)
        self.cache.cache_computed(req)
        self.cache.free(req)
        req.status = status
        req.error = error
        req.error_code = error_code if error else ""
        self._on_output(req)

    def _pick_victim(self, exclude: Request, scheduled: SchedulePlan) -> Request | None:
        """The newest running request that is not `exclude` (it loses the least work)."""
        in_plan = {id(c.request) for c in scheduled.chunks}
        for req in reversed(self.running):
            if req is not exclude and id(req) not in in_plan:
                return req
        for req in reversed(self.running):
            if req is not exclude:
                return req
        return None

    def _preempt(self, req: Request, plan: SchedulePlan) -> None:
        for chunk in plan.chunks:
            if chunk.request is req:  # scheduled earlier this step: take it back out
                plan.chunks.remove(chunk)
                plan.num_tokens -= chunk.num_tokens
                break
        self.cache.cache_computed(req)
        self.cache.free(req)
        self.running.remove(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    # ---- the PD roles' interface (worker/prefill.py, worker/decode.py) ---------------------------
    def expect_remote(self, req: Request) -> None:
        """Decode: the request waits (holding nothing yet) for its KV to come from prefill."""
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV

    def fits(self, num_tokens: int) -> bool:
        return self.cache.fits(num_tokens)

    def reserve(self, req: Request, num_tokens: int) -> bool:
        """Decode: a seat in the running batch and memory for `num_tokens` tokens in every
        group, or nothing (False: retry). Preempted requests (waiting to recompute) go first:
        they have streamed tokens already."""
        if self.waiting or len(self.running) + len(self._seats) >= self.config.max_num_seqs:
            return False
        if not self.cache.reserve(req, num_tokens):
            return False
        self._seats.add(req)
        return True

    def holdings(self, req: Request) -> Holdings:
        """What the request holds per group: what a room ships from (prefill) or lands in."""
        return self.cache.holdings(req)

    def land(self, req: Request, token: int, logprob: TokenLogprob | None) -> bool:
        """Decode: the room's KV and first token arrived; the prompt counts as computed.
        True = the request waits for a seat (`seat`); False = the first token finished it."""
        req.num_computed_tokens = req.num_prompt_tokens
        req.output_token_ids.append(token)
        if logprob is not None:
            req.output_logprobs.append(logprob)
        self._on_output(req)
        stop = self.stop_status(req)
        if stop is not None:
            self.finish(req, stop)
            return False
        return True

    def seat(self, req: Request) -> bool:
        """Decode: a landed request joins the running batch: in the seat it reserved, else if
        one is free."""
        full = len(self.running) + len(self._seats) >= self.config.max_num_seqs
        if req not in self._seats and full:
            return False
        self._seats.discard(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return True

    def hold(self, req: Request, holder: str) -> CacheHold:
        """Keep an ended request's memory held under `holder` (decode's quarantine)."""
        return self.cache.hold(req, holder)

    def hold_pages(self, pages: list[int], holder: str) -> CacheHold:
        """Keep pages a room's writes will read under `holder` (prefill, layer-wise)."""
        return self.cache.hold_pages(pages, holder)

    def release_hold(self, hold: CacheHold) -> None:
        self.cache.release_hold(hold)

    # ---- reports -----------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> SchedulerStats:
        cache = self.cache.stats()
        return SchedulerStats(
            running=len(self.running), waiting=len(self.waiting), used_pages=cache.used_pages,
            total_pages=cache.total_pages, cached_pages=cache.cached_pages,
            free_pages=self.cache.num_free_pages, window_used_pages=cache.window_used_pages,
            prompt_tokens_computed=self.prompt_tokens_computed)

    def assert_drained(self) -> None:
        """No request left and no memory held. Tests end with this."""
        assert not self.waiting and not self.running, "requests left in the queues"
        assert not self._seats, "seats still held"
        self.cache.assert_drained()
