"""The engine: one loop thread that owns the scheduler, the runner and the KV cache.

Other threads (the gRPC server) talk to it only through `submit` and `abort`, which post to an
inbox drained at the top of every step. Outputs leave once per step: `_flush` groups what the
step produced by output channel and hands each channel one `StepOutputs` batch
(worker/outputs.py), so the loop does no per-request network work.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from protocol.bootstrap_addr import group_of
from worker.cache_groups import WindowSpec
from worker.cache_layout import kv_shape, max_model_len, prefix_cache_enabled, state_slots
from worker.cache_manager import KVCacheManager
from worker.config import WorkerConfig
from worker.dp_groups import pick_group
from worker.dp_runner import DPRunner
from worker.fast_paths import mixed_graphs_supported, overlap_enabled, piecewise_supported
from worker.grammar import Grammars
from worker.kv_cache import KVCache
from worker.model import load_model
from worker.outputs import OutputChannel, PerRequestSink, RequestEnded, RequestOutput, StepOutputs
from worker.request import Request, RequestStatus
from worker.runner import InFlight, ModelRunner
from worker.sampler import GrammarViolation, make_generator, skip_draw
from worker.sampling import SamplingParams, SamplingParamsError
from worker.scheduler import RoleHooks, Scheduler
from worker.spec import make_drafter
from worker.spec.counters import SpecCounters
from worker.spec.drafter import ModelDrafter
from worker.spec.load import load_head
from worker.spec.tp import leader_head_run
from worker.step import PENDING, SchedulePlan
from worker.tp_runner import TPLeader

log = logging.getLogger(__name__)

__all__ = ["Engine", "OutputSink", "RequestOutput"]

OutputSink = Callable[[RequestOutput], None]


@dataclass(slots=True)
class _Tracked:
    request: Request
    channel: OutputChannel
    tag: int  # the channel's id for this request
    num_emitted: int = 0  # output tokens already sent


class Engine:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.device = torch.device(config.parallel.device)
        if config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        self.overlap = overlap_enabled(config, self.device)  # first: may refuse before ranks spawn
        self.tp: TPLeader | None = None  # multi-rank worker: this is rank 0 and drives the others
        par = config.parallel
        if par.world_size > 1 or par.nnodes > 1:
            self.tp = TPLeader(config)
        self.model, self.spec = load_model(config.model, par)
        # A model drafter (draft | eagle | mtp) is loaded on every role: prefill computes its
        # KV for the prompt (in the pages it ships) and its last feature (sent with the token).
        self.draft_head = load_head(config, self.model, self.spec)
        if self.tp is not None and par.dp_size == 1:
            self.model = self.tp.wrap_model(self.model)  # broadcasts each batch to the other ranks
        self.max_model_len = max_model_len(self.spec, config)
        layers, label = ((self.draft_head.head.num_layers, self.draft_head.label) if self.draft_head
                         else (0, ""))
        self.kv = KVCache(kv_shape(self.spec, config, layers, label), self.device)
        pool = self.kv.shape.num_pages * self.kv.shape.page_size  # no request outgrows the pool
        if pool < self.max_model_len:
            log.warning("max_model_len %d -> %d: the KV pool holds %d tokens (raise "
                        "cache.max_total_tokens for more)", self.max_model_len, pool, pool)
            self.max_model_len = pool
        # Decode and mono workers draft (speculative decoding); prefill only ships prompts.
        drafts = config.role != "prefill" and config.speculative.enabled
        k = config.speculative.num_speculative_tokens if drafts else 0
        # A bucket for each count of accepted drafts, 0..k, from the start (a fixed histogram).
        self.spec_counters = SpecCounters(accepted_hist=[0] * (k + 1) if drafts else [])
        model_drafter = self._model_drafter()
        self.drafter = make_drafter(config.speculative, model_drafter) if drafts else None
        # One scheduler per attention DP group, each over its group's own KV cache.
        self.schedulers = [
            Scheduler(config.scheduler, self._cache_manager(), max_model_len=self.max_model_len,
                      eos_token_ids=self.spec.eos_token_ids, on_output=self._touch,
                      num_speculative_tokens=k, spec_counters=self.spec_counters)
            for _ in range(par.dp_size)
        ]
        self.scheduler = self.schedulers[0]  # the only one unless dp_size > 1
        self.runner = ModelRunner(self.model, self.kv, eos_token_ids=self.spec.eos_token_ids,
                                  device=self.device)
        self.runner.drafter = model_drafter  # catches up after every forward, on every role
        self.hooks: RoleHooks | None = None  # the PD role's (worker/prefill.py, worker/decode.py)
        self.dp: DPRunner | None = None
        if par.dp_size > 1:
            assert self.tp is not None
            self.dp = DPRunner(self.runner, self.tp.channel, par.tp_size, par.dp_size,
                               self.spec.vocab_size)
        self._inflight: InFlight | None = None  # the launched overlapped step, tokens not read yet
        self._inbox: queue.SimpleQueue[tuple[str, object, object]] = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}
        self._touched: dict[str, _Tracked] = {}  # requests with something to emit after this step
        self._group: dict[str, int] = {}  # request id -> its DP group (dp_size > 1)
        # PD room -> the DP group holding its pages (dp_size > 1)
        self._room_group: dict[int, int] = {}
        self.num_steps = 0
        self.num_overlapped_steps = 0
        # Constrained decoding (worker/grammar.py): xgrammar loads with the first grammar.
        self.grammars = Grammars(config.model.path, self.spec.vocab_size, self.spec.eos_token_ids)

    def _model_drafter(self) -> ModelDrafter | None:
        if self.draft_head is None:
            return None
        head, run = self.draft_head.head, None
        if self.tp is not None:  # every rank runs each head call on its shard
            run = leader_head_run(head, self.kv, self.tp.channel)
        return ModelDrafter(head, self.kv, self.device, self.spec.dtype,
                            counters=self.spec_counters, run=run)

    def _cache_manager(self) -> KVCacheManager:
        shape = self.kv.shape
        window = None
        if shape.window_layers:
            window = WindowSpec(shape.window, len(shape.window_layers), shape.page_size)
        requests, snapshots = state_slots(self.spec, self.config)
        # An eagle/mtp head's KV at a prefix hit's last position was computed with the token
        # after it, which this request may not share: the hit gives back its last page, which
        # is recomputed (target and head), as vLLM does for EAGLE.
        drop_last = self.draft_head is not None and self.draft_head.head.needs_hidden
        return KVCacheManager(shape.num_pages, shape.page_size,
                              prefix_cache=prefix_cache_enabled(self.spec, self.config),
                              window=window,
                              num_window_pages=shape.num_window_pages,
                              num_state_slots=requests, num_state_snapshots=snapshots,
                              hit_drops_last_page=drop_last)

    def set_hooks(self, hooks: RoleHooks) -> None:
        self.hooks = hooks
        for sched in self.schedulers:
            sched.hooks = hooks  # each group's prompts end in the role (prefill ships them)

    # ---- called from any thread -------------------------------------------------------------
    def submit(self, request: Request, sink: OutputSink) -> None:
        """Run `request`; `sink` gets its outputs one `RequestOutput` at a time."""
        self._inbox.put(("add", request, (PerRequestSink(request.request_id, sink), 0)))

    def submit_to(self, request: Request, channel: OutputChannel, tag: int) -> None:
        """Run `request`; its outputs go to `channel`'s per-step batches under `tag`."""
        self._inbox.put(("add", request, (channel, tag)))

    def abort(self, request_id: str, reason: str = "aborted") -> None:
        self._inbox.put(("abort", request_id, reason))

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the loop thread before the next step (role managers use this)."""
        self._inbox.put(("call", fn, None))

    # ---- the loop ------------------------------------------------------------------------------
    def run_forever(self, stop: threading.Event, idle_wait_s: float = 0.05) -> None:
        while not stop.is_set():
            if not self.step():
                self._drain_inbox(block_s=idle_wait_s if not self.has_pending_work() else 0.001)

    def has_pending_work(self) -> bool:
        return bool(self._tracked) or self._inflight is not None

    def step(self) -> bool:
        """One schedule → run → update. Returns False when there was nothing to run.

        Overlapped steps (`scheduler.overlap`): a plan of decodes (and, outside PD roles,
        prompt chunks) is launched, counted in the scheduler with its tokens PENDING, and only
        then are the previous step's tokens read and processed — while the device runs this
        one. Any other plan first reads them, and sends them out before it runs.
        """
        self._drain_inbox(block_s=0.0)
        if self.hooks is not None:
            self.hooks.poll()  # rooms that ended, pages reserved, requests seated
            self._flush()  # a landed first token leaves now, not after a step (its TTFT)
        plans = [s.schedule() for s in self.schedulers]
        if self.drafter is not None and not all(p.empty for p in plans):  # idle: no drafting
            t0 = time.perf_counter()
            for plan in plans:
                self.drafter.draft(plan)
            self.spec_counters.draft_seconds += time.perf_counter() - t0
        overlapped = self._overlappable(plans)
        if self._inflight is not None and not overlapped:
            self._complete_inflight()  # this plan reads tokens the host must hold first
            for plan in plans:  # a request that stopped on those tokens has given its pages back
                plan.drop_finished()
            # Those tokens leave now, not after this plan's run (a mixed step costs 2-3
            # decode steps: bench/served.py's step times).
            self._flush()
            if all(p.empty for p in plans):
                return True
        if all(p.empty for p in plans):
            self._flush()
            return False
        if overlapped:
            return self._overlap_step(plans[0])
        verify = any(c.drafts for p in plans for c in p.chunks)
        t0, drafting = time.perf_counter(), self.spec_counters.draft_seconds
        try:
            outs = self.dp.run(plans) if self.dp is not None else [self.runner.run(plans[0])]
        except GrammarViolation as exc:  # that request fails; the others advanced nothing: rerun
            why = f"internal error: {exc}" if exc.error_code == "internal" else str(exc)
            self.schedulers[self._group.get(exc.request_id, 0)].end(
                exc.request_id, RequestStatus.FINISHED_ERROR, why, exc.error_code)
            self._flush()
            return True
        except Exception as exc:
            self._fail(plans, exc)
            return True
        if verify:  # the drafter's catch-up inside the run counts as drafting
            caught_up = self.spec_counters.draft_seconds - drafting
            self.spec_counters.verify_seconds += time.perf_counter() - t0 - caught_up
            self.spec_counters.verify_steps += 1
        for sched, plan, out in zip(self.schedulers, plans, outs, strict=True):
            if plan.empty:
                continue
            sched.update(plan, out)
            for chunk in plan.chunks:
                tracked = self._tracked.get(chunk.request.request_id)
                if tracked is not None and chunk.sample:
                    self._touched[chunk.request.request_id] = tracked
        self.num_steps += 1
        self._flush()
        return True

    def _overlappable(self, plans: list[SchedulePlan]) -> bool:
        """A plan the overlapped path runs: one group, no drafts, a chunk that samples, every
        request needing no host view of its newest token (penalties read them, a grammar's next
        mask needs it, logprobs stay eager). Prompt chunks join decodes there too (mixed steps),
        unless a PD role must hear of a prompt's end with its first token (prefill ships it)."""
        if not self.overlap or len(plans) != 1 or plans[0].empty or plans[0].state_copies:
            return False
        chunks = plans[0].chunks
        prompts = self.hooks is None
        return any(c.sample for c in chunks) and all(
            not c.drafts and not c.max_drafts
            and (prompts or (c.num_tokens == 1 and c.sample and c.request.output_token_ids))
            and not c.request.sampling.has_penalties
            and not (c.request.sampling.logprobs or c.request.sampling.top_logprobs)
            and c.request.grammar is None
            for c in chunks
        )

    def _overlap_step(self, plan: SchedulePlan) -> bool:
        try:
            launched = self.runner.launch(plan, self._inflight)
        except Exception as exc:
            if self._inflight is not None:
                self._complete_inflight()
            self._fail([plan], exc)
            return True
        self.scheduler.advance(plan)
        self.num_overlapped_steps += 1
        if self._inflight is not None:
            self._complete_inflight()  # the device is busy with `launched` meanwhile
        self._inflight = launched
        self.num_steps += 1
        self._flush()
        return True

    def _fail(self, plans: list[SchedulePlan], exc: Exception) -> None:
        """A bug or a device error in a step: fail the step's requests, keep serving."""
        log.error("step failed, failing %d requests:\n%s", sum(len(p.chunks) for p in plans),
                  traceback.format_exc())
        # overlap: one plan, one group
        for sched, plan in zip(self.schedulers, plans, strict=False):
            for chunk in plan.chunks:
                sched.end(chunk.request.request_id, RequestStatus.FINISHED_ERROR,
                          f"internal error: {exc}")
        self._flush()

    def _complete_inflight(self) -> None:
        inflight, self._inflight = self._inflight, None
        assert inflight is not None
        self.scheduler.complete(inflight.plan, inflight.token_ids())
        for chunk in inflight.plan.chunks:
            tracked = self._tracked.get(chunk.request.request_id)
            if tracked is not None:
                self._touched[chunk.request.request_id] = tracked

    def _drain_inbox(self, block_s: float) -> None:
        try:
            item = self._inbox.get(timeout=block_s) if block_s > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item: tuple[str, object, object]) -> None:
        kind, a, b = item
        if kind == "add":
            assert isinstance(a, Request) and isinstance(b, tuple)
            self._tracked[a.request_id] = _Tracked(a, b[0], b[1])
            a.generator = make_generator(a.sampling.seed, self.device)
            if a.generator is not None and self.config.role == "decode" and not a.sampling.greedy:
                skip_draw(a.generator, self.spec.vocab_size)  # prefill drew the first token
            try:
                self.grammars.attach(a)  # its matcher, when it has sampling.structured
            except SamplingParamsError as exc:
                self.scheduler_for(a).finish(a, RequestStatus.FINISHED_ERROR, str(exc), "invalid")
                self._flush()
                return
            self.add_request(a)
        elif kind == "abort":
            self.abort_now(str(a), str(b))
        elif kind == "call":
            a()  # type: ignore[operator]

    def add_request(self, request: Request) -> None:
        """Loop thread: hand a new request to its role (or straight to a scheduler)."""
        sched = self.scheduler_for(request)  # first: a room's DP group decides its ranks
        if self.hooks is not None:
            self.hooks.add_request(request, sched)
        else:
            sched.add(request)

    def scheduler_for(self, request: Request) -> Scheduler:
        """The scheduler of the DP group a request lives in, chosen at its first call and kept.

        Prefill puts room r in group r % dp_size (protocol/bootstrap_addr.py), the rule decode
        uses to pick which of the prefill's groups to register with; elsewhere the group holding
        the request's prefix, within a load bound (worker/dp_groups.py). Without DP it is the
        one scheduler.
        """
        if self.dp is None:
            return self.scheduler
        group = self._group.get(request.request_id)
        if group is None:
            if self.config.role == "prefill":
                group = group_of(request.room, len(self.schedulers))
            else:
                group = pick_group(self.schedulers, request.all_token_ids())
            self._group[request.request_id] = group
            if request.room:
                self._room_group[request.room] = group
        return self.schedulers[group]

    def group_of_room(self, room: int) -> int:
        """The DP group a PD room's pages are in (the multi-rank room facade asks)."""
        return self._room_group.get(room, 0)

    def abort_now(self, request_id: str, reason: str) -> None:
        """Loop thread: end a request wherever it is (queues, running batch, role queues)."""
        if request_id in self._tracked:
            self.schedulers[self._group.get(request_id, 0)].abort(request_id, reason)
            if self.hooks is not None:
                self.hooks.abort(request_id, reason)  # closes its room too

    def _touch(self, req: Request) -> None:
        """The request has something to stream at the next flush (it finished, or a PD room
        landed its first token)."""
        tracked = self._tracked.get(req.request_id)
        if tracked is not None:
            self._touched[req.request_id] = tracked

    def _flush(self) -> None:
        """Everything this step produced, one batch per channel (the only place outputs leave)."""
        if not self._touched:
            return
        batches: dict[OutputChannel, StepOutputs] = {}
        for rid, tracked in self._touched.items():
            req = tracked.request
            emitted = tracked.num_emitted
            toks = req.output_token_ids
            end = len(toks)
            while end > emitted and toks[end - 1] == PENDING:
                end -= 1  # still on the device (overlapped decode): sent with the next flush
            done = req.status.is_finished
            if end == emitted and not done:
                continue
            out = batches.get(tracked.channel)
            if out is None:
                out = batches[tracked.channel] = StepOutputs()
            tag = tracked.tag
            if emitted == 0:
                out.started.append((tag, req.num_prompt_tokens, req.num_cached_tokens))
            if end > emitted:
                out.tags.append(tag)
                out.num_tokens.append(end - emitted)
                out.token_ids.extend(toks[emitted:end])
                lps = req.output_logprobs[emitted:end] if req.output_logprobs else ()
                out.num_logprobs.append(len(lps))
                out.logprobs.extend(lps)
                tracked.num_emitted = end
            if done:
                self.grammars.release(req)  # every end (stop, length, abort, error) frees it
                out.ended.append(RequestEnded(tag, req.finish_reason, req.error, req.error_code,
                                              req.transfer_stats))
                del self._tracked[rid]
                self._group.pop(rid, None)
                self._room_group.pop(req.room, None)
        self._touched.clear()
        for channel, out in batches.items():
            channel.deliver(out)

    def close(self) -> None:
        """Stop the other ranks of a multi-rank worker (after the loop thread has stopped)."""
        if self.tp is not None:
            self.tp.close()

    # ---- warm-up -------------------------------------------------------------------------------
    def warm_up(self, timeout_s: float = 120.0) -> None:
        """Run one tiny request through the real path before reporting SERVING."""
        done = threading.Event()
        req = Request("warmup", [0] * min(8, self.max_model_len - 1),
                      SamplingParams(max_tokens=2, ignore_eos=True))
        sink = PerRequestSink(req.request_id, lambda out: done.set() if out.finished else None)
        self._tracked[req.request_id] = _Tracked(req, sink, 0)
        self.scheduler.add(req)  # straight to the scheduler: no room, whatever the role
        deadline = time.monotonic() + timeout_s
        while not done.is_set():
            if time.monotonic() > deadline:
                raise RuntimeError("warm-up step did not finish")
            self.step()
        if req.status is RequestStatus.FINISHED_ERROR:
            raise RuntimeError(f"warm-up failed: {req.error}")
        self.scheduler.prompt_tokens_computed = 0  # count only real requests
        self.spec_counters.reset()
        if (self.device.type == "cuda" and not self.config.model.enforce_eager
                and self.model.supports_cuda_graphs
                and not self.kv.shape.window_layers):  # the graphs carry no window ring fields
            self.enable_decode_graphs()

    def enable_decode_graphs(self) -> None:
        """Capture the decode graphs; a multi-rank worker's ranks all capture the same buckets
        (worker/cuda_graphs.py). On a CPU the same static-buffer steps run eagerly (tests)."""
        max_num_seqs = self.config.scheduler.max_num_seqs
        if self.dp is not None:
            self.dp.enable_cuda_graphs(max_num_seqs, self.max_model_len)
        else:  # speculative decoding: verify graphs too, at k + 1 tokens per request
            k = self.config.speculative.num_speculative_tokens if self.drafter is not None else 0
            self.runner.enable_cuda_graphs(max_num_seqs, self.max_model_len, k)
            model_drafter = self.runner.drafter
            if k and model_drafter is not None:  # and a model drafter's draft steps
                model_drafter.enable_cuda_graphs(max_num_seqs, self.max_model_len, k,
                                                 self.spec.hidden_size)
        if piecewise_supported(self):
            chunk = self.config.scheduler.chunked_prefill_size
            self.runner.enable_piecewise_graphs(chunk)
            if mixed_graphs_supported(self):
                self.runner.enable_mixed_graphs(chunk, max_num_seqs, self.max_model_len)
