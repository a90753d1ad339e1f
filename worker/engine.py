"""The engine: one loop thread that owns the scheduler, the runner and the KV cache.

Other threads (the gRPC server) talk to it only through `submit` and `abort`, which post to an
inbox drained at the top of every step; outputs leave through each request's sink, called on
the loop thread (the server's sink hops them onto its event loop).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from worker.config import ConfigError, WorkerConfig
from worker.dp_runner import DPRunner
from worker.grammar import Grammars
from worker.kv_cache import KVCache, KVShape
from worker.model import ModelSpec, load_model
from worker.request import Request, RequestStatus, TokenLogprob
from worker.runner import InFlight, ModelRunner
from worker.sampler import GrammarViolation
from worker.sampling import SamplingParamsError
from worker.scheduler import PENDING, RoleHooks, SchedulePlan, Scheduler, WindowCache

if TYPE_CHECKING:
    from worker.tp_runner import TPLeader

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What a request produced since its previous output (the server turns it into a message)."""

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


OutputSink = Callable[[RequestOutput], None]


@dataclass
class _Tracked:
    request: Request
    sink: OutputSink
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
            from worker.tp_runner import TPLeader

            self.tp = TPLeader(config)
        self.model, self.spec = load_model(config.model, par)
        if self.tp is not None and par.dp_size == 1:
            self.model = self.tp.wrap_model(self.model)  # broadcasts each batch to the other ranks
        self.max_model_len = min(
            config.model.max_model_len or self.spec.max_position_embeddings, self.spec.max_position_embeddings
        )
        num_pages = config.cache.total_pages
        self.kv = KVCache(kv_shape(self.spec, config, num_pages, self.max_model_len), self.device)
        shape = self.kv.shape
        window = None
        if shape.window_layers:
            window = WindowCache(shape.window, len(shape.window_layers), shape.ring_pages, shape.num_window_pages)
        # One scheduler per attention DP group, each over its group's own pool of num_pages pages.
        self.schedulers = [
            Scheduler(config.scheduler, config.cache, num_pages=num_pages, max_model_len=self.max_model_len,
                      eos_token_ids=self.spec.eos_token_ids, on_finish=self._on_finish, window=window)
            for _ in range(par.dp_size)
        ]
        self.scheduler = self.schedulers[0]  # the only one unless dp_size > 1; roles use it
        self.runner = ModelRunner(self.model, self.kv, eos_token_ids=self.spec.eos_token_ids, device=self.device)
        self.hooks: RoleHooks | None = None  # the PD role's (worker/prefill.py, worker/decode.py)
        self.dp: DPRunner | None = None
        if par.dp_size > 1:
            assert self.tp is not None
            self.dp = DPRunner(self.runner, self.tp.channel, par.tp_size, par.dp_size, self.spec.vocab_size)
        self._inflight: InFlight | None = None  # the launched overlapped step, tokens not read yet
        self._inbox: queue.SimpleQueue[tuple[str, object, object]] = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}
        self._touched: dict[str, _Tracked] = {}  # requests with something to emit after this step
        self._group: dict[str, int] = {}  # request id -> its DP group (dp_size > 1)
        self._room_group: dict[int, int] = {}  # PD room -> the DP group holding its pages (dp_size > 1)
        self.num_steps = 0
        self.num_overlapped_steps = 0
        # Constrained decoding (worker/grammar.py): xgrammar loads with the first grammar.
        self.grammars = Grammars(config.model.path, self.spec.vocab_size, self.spec.eos_token_ids)

    def set_hooks(self, hooks: RoleHooks) -> None:
        self.hooks = hooks
        for sched in self.schedulers:
            sched.hooks = hooks  # each group's prompts end in the role (prefill ships them)

    # ---- called from any thread -------------------------------------------------------------
    def submit(self, request: Request, sink: OutputSink) -> None:
        self._inbox.put(("add", request, sink))

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

        Overlapped decode (`scheduler.overlap`): a pure-decode plan is launched, counted in the
        scheduler with its tokens PENDING, and only then are the previous step's tokens read
        and processed — while the device runs this one. Any other plan first reads them.
        """
        self._drain_inbox(block_s=0.0)
        if self.hooks is not None:
            self.hooks.poll()  # rooms that ended, pages reserved, requests seated
        plans = [s.schedule() for s in self.schedulers]
        overlapped = self._overlappable(plans)
        if self._inflight is not None and not overlapped:
            self._complete_inflight()  # this plan reads tokens the host must hold first
            for plan in plans:  # a request that stopped on those tokens has given its pages back
                plan.chunks = [c for c in plan.chunks if c.request.status is RequestStatus.RUNNING]
                plan.num_tokens = sum(c.num_tokens for c in plan.chunks)
            if all(p.empty for p in plans):
                self._flush()
                return True
        if all(p.empty for p in plans):
            self._flush()
            return False
        if overlapped:
            return self._overlap_step(plans[0])
        try:
            outs = self.dp.run(plans) if self.dp is not None else [self.runner.run(plans[0])]
        except GrammarViolation as exc:  # that request fails; the others advanced nothing: rerun
            self.schedulers[self._group.get(exc.request_id, 0)].end(
                exc.request_id, RequestStatus.FINISHED_ERROR, f"internal error: {exc}")
            self._flush()
            return True
        except Exception as exc:
            self._fail(plans, exc)
            return True
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
        """A plan the overlapped path runs: one group, every chunk a decode of a request that
        needs no host view of its newest token (penalties read them; logprobs stay eager)."""
        if not self.overlap or len(plans) != 1 or plans[0].empty:
            return False
        return all(
            c.num_tokens == 1 and c.sample and c.request.output_token_ids and not c.request.sampling.has_penalties
            and not (c.request.sampling.logprobs or c.request.sampling.top_logprobs)
            and c.request.grammar is None  # its next mask needs this step's token on the host
            for c in plans[0].chunks
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
        log.error("step failed, failing %d requests:\n%s", sum(len(p.chunks) for p in plans), traceback.format_exc())
        for sched, plan in zip(self.schedulers, plans, strict=False):  # overlap: one plan, one group
            for chunk in plan.chunks:
                req = chunk.request
                if req.status is RequestStatus.RUNNING:
                    sched.running.remove(req)
                    sched.finish(req, RequestStatus.FINISHED_ERROR, f"internal error: {exc}")
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
            assert isinstance(a, Request)
            self._tracked[a.request_id] = _Tracked(a, b)  # type: ignore[arg-type]
            if a.sampling.seed is not None:
                a.generator = torch.Generator(device=self.device).manual_seed(a.sampling.seed)
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
        if self.hooks is not None:
            self.hooks.add_request(request)
        else:
            self.scheduler_for(request).add(request)

    def scheduler_for(self, request: Request) -> Scheduler:
        """The scheduler of the DP group a request lives in, chosen at its first call and kept.

        Prefill puts room r in group r % dp_size, the rule decode uses to pick which of the
        prefill's groups to register with (transfer/manager.py); elsewhere the least busy group,
        then the one with the most free pages (SGLang's shortest-queue dispatch). Without DP it
        is the one scheduler.
        """
        if self.dp is None:
            return self.scheduler
        group = self._group.get(request.request_id)
        if group is None:
            if self.config.role == "prefill":
                group = request.room % len(self.schedulers)
            else:
                loads = [(len(s.running) + len(s.waiting), -s.pool.num_free) for s in self.schedulers]
                group = loads.index(min(loads))
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

    def _on_finish(self, req: Request) -> None:
        tracked = self._tracked.get(req.request_id)
        if tracked is not None:
            self._touched[req.request_id] = tracked

    def emit(self, req: Request) -> None:
        """Role managers call this when a request has news outside a step (first token landed)."""
        tracked = self._tracked.get(req.request_id)
        if tracked is not None:
            self._touched[req.request_id] = tracked

    def _flush(self) -> None:
        for rid, tracked in self._touched.items():
            req = tracked.request
            first = tracked.num_emitted == 0
            end = len(req.output_token_ids)
            while end > tracked.num_emitted and req.output_token_ids[end - 1] == PENDING:
                end -= 1  # still on the device (overlapped decode): sent with the next flush
            new = req.output_token_ids[tracked.num_emitted : end]
            new_lp = req.output_logprobs[tracked.num_emitted : end] if req.output_logprobs else []
            tracked.num_emitted = end
            done = req.status.is_finished
            if not new and not done:
                continue
            tracked.sink(
                RequestOutput(
                    request_id=rid,
                    token_ids=list(new),
                    logprobs=list(new_lp),
                    finish_reason=req.finish_reason if done else "",
                    error=req.error,
                    error_code=req.error_code,
                    num_prompt_tokens=req.num_prompt_tokens if first else 0,
                    num_cached_tokens=req.num_cached_tokens if first else 0,
                    transfer=req.transfer_stats if done else None,
                )
            )
            if done:
                self.grammars.release(req)  # every end (stop, length, abort, error) frees it
                del self._tracked[rid]
                self._group.pop(rid, None)
                self._room_group.pop(req.room, None)
        self._touched.clear()

    def close(self) -> None:
        """Stop the other ranks of a multi-rank worker (after the loop thread has stopped)."""
        if self.tp is not None:
            self.tp.close()

    # ---- warm-up -------------------------------------------------------------------------------
    def warm_up(self, timeout_s: float = 120.0) -> None:
        """Run one tiny request through the real path before reporting SERVING."""
        from worker.sampling import SamplingParams

        done = threading.Event()
        req = Request("warmup", [0] * min(8, self.max_model_len - 1), SamplingParams(max_tokens=2, ignore_eos=True))
        self._tracked[req.request_id] = _Tracked(req, lambda out: done.set() if out.finished else None)
        self.scheduler.add(req)  # straight to the scheduler: no room, whatever the role
        deadline = time.monotonic() + timeout_s
        while not done.is_set():
            if time.monotonic() > deadline:
                raise RuntimeError("warm-up step did not finish")
            self.step()
        if req.status is RequestStatus.FINISHED_ERROR:
            raise RuntimeError(f"warm-up failed: {req.error}")
        if (self.device.type == "cuda" and not self.config.model.enforce_eager and self.model.supports_cuda_graphs
                and not self.kv.shape.window_layers):  # the graphs carry no window ring fields
            self.runner.enable_cuda_graphs(self.config.scheduler.max_num_seqs, self.max_model_len)


def overlap_enabled(config: WorkerConfig, device: torch.device) -> bool:
    """`scheduler.overlap`: auto = on for a single-rank CUDA worker. Multi-rank workers send each
    step's input ids to their followers from the host, so a PENDING id cannot travel there."""
    mode, par = config.scheduler.overlap, config.parallel
    multi_rank = par.world_size > 1 or par.nnodes > 1
    if mode == "on" and multi_rank:
        raise ConfigError("scheduler.overlap=on needs a single-rank worker (tp_size*dp_size = 1); "
                          "set scheduler.overlap: auto or off for multi-rank workers")
    return mode == "on" or (mode == "auto" and device.type == "cuda" and not multi_rank)


WINDOW_RINGS_PER_SEQ = 2  # window rings per running seat: decode also holds rings of rooms in flight


def window_layers(spec: ModelSpec, max_model_len: int) -> tuple[tuple[int, ...], int]:
    """The layers that get a window ring, and their window; ((), 0) = keep every layer in full pages.

    A ring needs a window shorter than the context and at least one full-attention layer (an
    all-window model would have an empty full page; it keeps today's masked full pages), and
    one window size for all window layers (one ring geometry per request).
    """
    windows = spec.layer_windows
    layers = tuple(i for i, w in enumerate(windows) if w is not None)
    sizes = {w for w in windows if w is not None}
    if not layers or len(layers) == len(windows) or len(sizes) != 1:
        return (), 0
    (window,) = sizes
    if window >= max_model_len:
        return (), 0  # the window never slides: plain full pages
    return layers, window


def kv_shape(spec: ModelSpec, config: WorkerConfig, num_pages: int, max_model_len: int | None = None) -> KVShape:
    tp = config.parallel.tp_size
    # With TP > kv heads each rank keeps a replica of one kv head.
    kv_heads = max(1, spec.num_kv_heads // tp)
    layers, window = window_layers(spec, max_model_len or spec.max_position_embeddings)
    if layers and (config.parallel.world_size > 1 or config.parallel.nnodes > 1):
        raise ConfigError(
            f"parallel: a model with sliding-window layers ({len(layers)} of {spec.num_layers}, window {window}) keeps "
            "window rings that multi-rank workers do not mirror yet; run it with parallel.tp_size=1")
    ring_pages = -(-window // config.cache.page_size) + 1 if layers else 0
    return KVShape(
        num_pages=num_pages,
        num_layers=spec.num_layers,
        num_kv_heads=kv_heads,
        page_size=config.cache.page_size,
        head_dim=spec.head_dim,
        dtype=spec.dtype,
        window_layers=layers,
        window=window,
        num_window_pages=ring_pages * WINDOW_RINGS_PER_SEQ * config.scheduler.max_num_seqs,
    )
