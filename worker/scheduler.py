"""The scheduler: continuous batching with chunked prefill, a prefix cache and preemption.

One engine step is three calls:

    plan = scheduler.schedule()        # who runs this step, how many tokens each
    out = runner.run(plan)             # one forward pass + sampling
    scheduler.update(plan, out)        # append tokens, finish, free pages

`schedule` fills a token budget (`chunked_prefill_size`): first the running batch (decodes take
one token, unfinished prompts their next chunk), then waiting requests in arrival order while
pages, `max_num_seqs` and the budget allow. When pages run out mid-batch, the newest running
request is preempted: its pages go back (through the prefix cache, so the recompute is cheap)
and it waits at the head of the queue to recompute. A request is never dropped: it finishes or
fails with a reason.

Hybrid models (window layers keeping a ring of pages, docs/hybrid-cache.md): each running
request also holds a ring of `ring_pages` window pages from a second pool, taken at admission.
A prefix hit cannot restore window rows (the tree keeps full pages only), so the scheduler
re-feeds a bounded suffix of the hit ("bounded replay"): the replayed tokens write no full
page (theirs sit in shared cached pages) and rebuild the ring exactly.

Roles hook in through `RoleHooks` (worker/prefill.py, worker/decode.py): prefill ships a request's
pages once its prompt is done instead of decoding; decode admits requests whose KV has landed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from worker.config import CacheConfig, ConfigError, SchedulerConfig
from worker.page_pool import OutOfPages, PagePool
from worker.prefix_cache import PrefixCache
from worker.request import Request, RequestStatus, TokenLogprob

PENDING = -1  # an output slot whose token is still on the device (overlapped decode)


@dataclass
class ScheduledChunk:
    """One request's share of a step."""

    request: Request
    start: int  # position of the first token computed this step (= num_computed_tokens)
    num_tokens: int  # tokens computed this step
    sample: bool  # the chunk reaches the request's last known token: sample the next one
    window_pages: list[int] = field(default_factory=list)  # the request's window ring (hybrid models)
    window_from: int = 0  # first position the ring holds valid rows for (start of a bounded replay)
    full_from: int = 0  # positions below keep their cached full-page KV: not written again (replay)


@dataclass(frozen=True)
class WindowCache:
    """The window group of a hybrid model, as the scheduler sees it."""

    window: int  # tokens a window layer attends to
    num_layers: int  # window layers (the bounded replay grows with their depth)
    ring_pages: int  # window pages per request
    num_pages: int  # window pages of the worker: the rings of all live requests

    @property
    def replay_tokens(self) -> int:
        """Tokens before a prefix hit's end to re-feed so every ring row is rebuilt exactly.

        Window layer l's KV at token p depends on window layer l-1's output at p, which reads
        layer l-1's KV of tokens p-W+1..p: each window layer pushes the dependency W-1 tokens
        back, so the rows tokens after the hit will read need num_layers * (W-1) tokens replayed.
        """
        return self.num_layers * (self.window - 1)


@dataclass
class SchedulePlan:
    """What `runner.run` executes; `update` reads it back."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    num_tokens: int = 0  # sum of chunk lengths: the step's token count

    @property
    def empty(self) -> bool:
        return not self.chunks


@dataclass
class RunOutput:
    """The runner's answer: one entry per chunk with `sample=True`, in plan order."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class RoleHooks(Protocol):
    """What a role adds around the step (worker/prefill.py, worker/decode.py). Mono has none."""

    def add_request(self, request: Request) -> None:
        """A new request arrives (prefill opens a room; decode reserves pages first)."""
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


FinishCallback = Callable[[Request], None]


class Scheduler:
    def __init__(
        self,
        scheduler: SchedulerConfig,
        cache: CacheConfig,
        *,
        num_pages: int,
        max_model_len: int,
        eos_token_ids: Iterable[int],
        on_finish: FinishCallback,
        window: WindowCache | None = None,
    ) -> None:
        self.config = scheduler
        self.page_size = cache.page_size
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.pool = PagePool(num_pages)
        self.prefix_cache = PrefixCache(self.pool, self.page_size) if cache.enable_prefix_cache else None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.hooks: RoleHooks | None = None  # the role's; the engine polls it once per step
        self._on_finish = on_finish  # the engine streams the final message and forgets the request
        self.num_preemptions = 0
        self.prompt_tokens_computed = 0  # tokens this worker ran that were prompt tokens
        self.window = window
        self.window_pool: PagePool | None = None
        self.rings: dict[str, list[int]] = {}  # request id -> its window ring (hybrid models)
        self._window_from: dict[str, int] = {}  # request id -> start of its ring's valid rows
        self._full_from: dict[str, int] = {}  # request id -> end of its replayed (cached) tokens
        if window is not None:
            if scheduler.chunked_prefill_size < window.window + self.page_size:
                raise ConfigError(
                    f"scheduler.chunked_prefill_size ({scheduler.chunked_prefill_size}) must be at least the model's "
                    f"sliding window plus one page ({window.window} + {self.page_size}) so a replayed window fits "
                    "one step; raise it")
            self.window_pool = PagePool(window.num_pages)

    # ---- intake ------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def abort(self, request_id: str, reason: str = "") -> bool:
        """End a waiting or running request now. Returns whether it was found here."""
        return self.end(request_id, RequestStatus.FINISHED_ABORTED, reason, "unavailable")

    def end(self, request_id: str, status: RequestStatus, error: str = "", error_code: str = "internal") -> bool:
        """Take a request out of the queues and finish it with `status`."""
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)  # type: ignore[arg-type]
                    self.finish(req, status, error, error_code)
                    return True
        return False

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- step 1: schedule ---------------------------------------------------------------------
    def schedule(self) -> SchedulePlan:
        plan = SchedulePlan()
        budget = self.config.chunked_prefill_size
        preempted = False
        for req in list(self.running):
            if budget == 0:
                break
            if req not in self.running:  # preempted earlier in this loop to make room
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self._grow(req, req.num_computed_tokens + n):
                victim = self._pick_victim(exclude=req, scheduled=plan)
                if victim is None:  # nothing left to preempt but the request itself
                    victim = req
                self._preempt(victim, plan)
                preempted = True
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            self._add_chunk(plan, req, n)
            budget -= n
        if not preempted:
            self._admit(plan, budget)
        return plan

    def _admit(self, plan: SchedulePlan, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if self._pages_for(req.num_tokens) > self.pool.num_pages:
                self.waiting.popleft()
                self.finish(req, RequestStatus.FINISHED_ERROR, (
                    f"request needs {req.num_tokens} tokens of KV cache but the worker holds only "
                    f"{self.pool.num_pages * self.page_size}; raise cache.max_total_tokens or shorten it"), "invalid")
                continue
            if not req.page_table and self.prefix_cache is not None:
                self._match_prefix(req)
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            # Admit only when the whole remaining prompt could fit, so chunked prefill does not
            # start what page pressure would immediately preempt.
            if self._pages_for(req.num_tokens) - len(req.page_table) > self._num_available() or not self._grow(
                req, req.num_computed_tokens + n
            ) or self.take_ring(req) is None:
                self._release_pages(req)  # give back prefix hits; retry next step
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._add_chunk(plan, req, n)
            budget -= n

    def _add_chunk(self, plan: SchedulePlan, req: Request, n: int) -> None:
        start = req.num_computed_tokens
        rid = req.request_id
        plan.chunks.append(ScheduledChunk(
            req, start, n, sample=start + n == req.num_tokens, window_pages=self.rings.get(rid, []),
            window_from=self._window_from.get(rid, 0), full_from=self._full_from.get(rid, 0),
        ))
        plan.num_tokens += n

    # ---- step 3: update ---------------------------------------------------------------------
    def update(self, plan: SchedulePlan, out: RunOutput) -> None:
        sampled = iter(zip(out.token_ids, out.logprobs, strict=True))
        for chunk in plan.chunks:
            req = chunk.request
            token = logprob = None
            if chunk.sample:
                token, logprob = next(sampled)
            if req.status is not RequestStatus.RUNNING:  # aborted while the step ran
                continue
            req.num_computed_tokens += chunk.num_tokens
            self.prompt_tokens_computed += max(0, min(req.num_prompt_tokens, req.num_computed_tokens) - chunk.start)
            if token is None:
                continue
            prompt_done = not req.output_token_ids
            req.output_token_ids.append(token)
            if logprob is not None:
                req.output_logprobs.append(logprob)
            if prompt_done:
                self._cache_computed(req)
                # Prefill ships even a request its first token already finished: decode owns
                # the stop decision and must hear about it.
                if self.hooks is not None and self.hooks.on_prompt_done(req):
                    self.running.remove(req)
                    continue
            status = self.stop_status(req)
            if status is not None:
                self.running.remove(req)
                self.finish(req, status)

    # ---- overlapped decode (the engine's overlap schedule) ----------------------------------------
    def advance(self, plan: SchedulePlan) -> None:
        """A pure-decode plan was launched and its tokens are not back yet: count each request's
        token computed and hold its output slot with PENDING, so the next plan can be scheduled
        now (its input for the slot is read on the device, worker/runner.py)."""
        for chunk in plan.chunks:
            chunk.request.num_computed_tokens += 1
            chunk.request.output_token_ids.append(PENDING)

    def complete(self, plan: SchedulePlan, token_ids: list[int]) -> None:
        """An advanced plan's tokens are back: fill each PENDING slot, then stop checks. A request
        that stops here may already sit in the next plan (launched): that step's token for it is
        dropped, and its pages are reused only by work queued after that step."""
        for chunk, token in zip(plan.chunks, token_ids, strict=True):
            req = chunk.request
            at = chunk.start + 1 - req.num_prompt_tokens  # the output index this chunk sampled
            if at >= len(req.output_token_ids) or req.output_token_ids[at] != PENDING:
                continue  # its output was cut (preempted and finished, or it stopped a step earlier)
            req.output_token_ids[at] = token
            queue = {RequestStatus.RUNNING: self.running, RequestStatus.WAITING: self.waiting}.get(req.status)
            if queue is None:  # finished meanwhile (aborted)
                continue
            status = self.stop_status(req, at + 1)  # a preempted request (waiting) can stop here too
            if status is not None:
                del req.output_token_ids[at + 1 :]  # the slot of the step that over-ran it
                queue.remove(req)  # type: ignore[attr-defined]
                self.finish(req, status)

    def stop_status(self, req: Request, num_out: int | None = None) -> RequestStatus | None:
        """Whether output token `num_out - 1` (default: the last) ends the request."""
        params = req.sampling
        num_out = len(req.output_token_ids) if num_out is None else num_out
        token = req.output_token_ids[num_out - 1]
        stopped = token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids)
        if stopped and num_out >= params.min_tokens:
            return RequestStatus.FINISHED_STOPPED
        if num_out >= params.max_tokens or req.num_prompt_tokens + num_out >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # ---- finishing -------------------------------------------------------------------------------
    def finish(self, req: Request, status: RequestStatus, error: str = "", error_code: str = "internal") -> None:
        """End `req`: cache its computed pages, free them exactly once, tell the engine."""
        assert not req.status.is_finished, f"{req.request_id} finished twice"
        self._cache_computed(req)
        self._release_pages(req)
        req.status = status
        req.error = error
        req.error_code = error_code if error else ""
        self._on_finish(req)

    # ---- pages ---------------------------------------------------------------------------------
    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _num_available(self) -> int:
        return self.pool.num_free + (self.pool.num_cached if self.prefix_cache is not None else 0)

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Make `req.page_table` cover `num_tokens` tokens, evicting cached pages if needed."""
        need = self._pages_for(num_tokens) - len(req.page_table)
        if need <= 0:
            return True
        if need > self.pool.num_free and self.prefix_cache is not None:
            self.prefix_cache.evict(need - self.pool.num_free)
        try:
            req.page_table.extend(self.pool.allocate(need, req.request_id))
        except OutOfPages:
            return False
        return True

    def _match_prefix(self, req: Request) -> None:
        assert self.prefix_cache is not None
        tokens = req.all_token_ids()
        pages = self.prefix_cache.match(tokens)
        # Leave at least one token to compute: its logits give the next token.
        while pages and len(pages) * self.page_size >= len(tokens):
            pages.pop()
        self.pool.share(pages, req.request_id)
        req.page_table = list(pages)
        hit = len(pages) * self.page_size
        req.num_computed_tokens = hit
        if self.window is not None and hit:
            # Bounded replay: the hit restores full pages only; re-feed the tail that rebuilds the
            # ring (page-aligned, so cached_tokens stays a multiple of the page size).
            replay_from = max(0, hit - self.window.replay_tokens) // self.page_size * self.page_size
            req.num_computed_tokens = replay_from
            self._window_from[req.request_id] = replay_from
            self._full_from[req.request_id] = hit
        if not req.output_token_ids and req.num_preemptions == 0:
            req.num_cached_tokens = req.num_computed_tokens

    def _cache_computed(self, req: Request) -> None:
        if self.prefix_cache is not None and req.page_table:
            self.prefix_cache.insert(req.all_token_ids()[: req.num_computed_tokens], req.page_table)

    def _release_pages(self, req: Request) -> None:
        if req.page_table:
            self.pool.release(req.page_table, req.request_id)
            req.page_table = []
        ring = self.rings.pop(req.request_id, None)
        if ring is not None:
            assert self.window_pool is not None
            self.window_pool.release(ring, req.request_id)
        self._window_from.pop(req.request_id, None)
        self._full_from.pop(req.request_id, None)

    def take_ring(self, req: Request) -> list[int] | None:
        """The request's window ring, allocated on first call; None when the window pool is
        short (the caller waits). A model without window layers needs none: []."""
        if self.window is None or self.window_pool is None:
            return []
        ring = self.rings.get(req.request_id)
        if ring is None:
            if self.window_pool.num_free < self.window.ring_pages:
                return None
            ring = self.rings[req.request_id] = self.window_pool.allocate(self.window.ring_pages, req.request_id)
        return ring

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
        self._cache_computed(req)
        self._release_pages(req)
        self.running.remove(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def assert_drained(self) -> None:
        """No request left and no page held. Tests end with this."""
        assert not self.waiting and not self.running, "requests left in the queues"
        self.pool.assert_drained()
        if self.window_pool is not None:
            assert not self.rings, f"window rings still held: {sorted(self.rings)}"
            self.window_pool.assert_drained()
