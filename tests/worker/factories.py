"""CPU-only factories for engine tests: requests and schedulers with no model behind them."""

from __future__ import annotations

import itertools

from worker.cache_manager import KVCacheManager
from worker.config import SchedulerConfig
from worker.request import Request
from worker.sampling import SamplingParams
from worker.scheduler import Scheduler
from worker.step import RunOutput, SchedulePlan

_ids = itertools.count()


def make_request(
    num_prompt_tokens: int = 10,
    max_tokens: int = 4,
    *,
    prompt: list[int] | None = None,
    ignore_eos: bool = True,
    **sampling: object,
) -> Request:
    tokens = (
        prompt if prompt is not None else [(7 * i + 3) % 97 + 1 for i in range(num_prompt_tokens)]
    )
    return Request(
        f"r{next(_ids)}",
        list(tokens),
        SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, **sampling),
    )  # type: ignore[arg-type]


def make_scheduler(
    *,
    num_pages: int = 64,
    page_size: int = 4,
    max_num_seqs: int = 8,
    chunked_prefill_size: int = 32,
    mixed_step_tokens: int = 0,
    prefix_cache: bool = True,
    max_model_len: int = 4096,
    eos: tuple[int, ...] = (0,),
) -> tuple[Scheduler, list[Request]]:
    finished: list[Request] = []
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, chunked_prefill_size=chunked_prefill_size,
                        mixed_step_tokens=mixed_step_tokens),
        KVCacheManager(num_pages, page_size, prefix_cache=prefix_cache),
        max_model_len=max_model_len,
        eos_token_ids=eos,
        on_output=lambda r: finished.append(r) if r.status.is_finished else None,
    )
    return sched, finished


def fake_run(plan: SchedulePlan, token: int = 5) -> RunOutput:
    """Stands in for the model: every sampled position yields `token`
    (a scheduler test needs no logits)."""
    n = sum(1 for c in plan.chunks if c.sample)
    return RunOutput(token_ids=[token] * n, logprobs=[None] * n)


def run_to_completion(sched: Scheduler, max_steps: int = 10_000, token: int = 5) -> int:
    steps = 0
    while sched.has_work:
        plan = sched.schedule()
        assert not plan.empty or not sched.running, "scheduler stalled with running requests"
        if plan.empty:
            raise AssertionError("scheduler stalled: waiting requests can never be admitted")
        sched.update(plan, fake_run(plan, token))
        steps += 1
        assert steps < max_steps
    return steps
