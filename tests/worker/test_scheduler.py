"""Scheduler tests on CPU with no model: admission, chunking, prefix hits, preemption, abort.

Every test ends with `assert_drained()`: no request left, no page held.
"""

from __future__ import annotations

import pytest

from tests.worker.factories import fake_run, make_request, make_scheduler, run_to_completion
from worker.request import RequestStatus


def test_single_request_runs_to_max_tokens() -> None:
    sched, finished = make_scheduler()
    req = make_request(10, max_tokens=4)
    sched.add(req)
    run_to_completion(sched)
    assert finished == [req]
    assert req.status is RequestStatus.FINISHED_LENGTH
    assert req.output_token_ids == [5, 5, 5, 5]
    sched.assert_drained()


def test_chunked_prefill_respects_token_budget() -> None:
    sched, _ = make_scheduler(chunked_prefill_size=8, page_size=4)
    long, short = make_request(30, max_tokens=2), make_request(3, max_tokens=2)
    sched.add(long)
    sched.add(short)
    plan = sched.schedule()
    assert [(c.request, c.start, c.num_tokens, c.sample) for c in plan.chunks] == [
        (long, 0, 8, False)
    ]
    sched.update(plan, fake_run(plan))
    plan = sched.schedule()
    assert plan.num_tokens <= 8 and plan.chunks[0].start == 8
    sched.update(plan, fake_run(plan))
    run_to_completion(sched)
    assert long.output_token_ids == [5, 5] and short.output_token_ids == [5, 5]
    sched.assert_drained()


def test_decodes_are_scheduled_before_new_prefills() -> None:
    sched, _ = make_scheduler(chunked_prefill_size=16)
    first = make_request(8, max_tokens=5)
    sched.add(first)
    sched.update(plan := sched.schedule(), fake_run(plan))
    second = make_request(40, max_tokens=1)
    sched.add(second)
    plan = sched.schedule()
    assert plan.chunks[0].request is first and plan.chunks[0].num_tokens == 1
    assert plan.chunks[1].request is second and plan.chunks[1].num_tokens == 15
    sched.update(plan, fake_run(plan))
    run_to_completion(sched)
    sched.assert_drained()


def test_steps_with_decodes_keep_to_mixed_step_tokens() -> None:
    """An idle worker prefills in chunked_prefill_size chunks; once a request decodes, a step
    carries at most mixed_step_tokens (its decodes included), and back to full chunks after."""
    sched, _ = make_scheduler(chunked_prefill_size=32, mixed_step_tokens=8, num_pages=128)
    first = make_request(40, max_tokens=6)
    sched.add(first)
    plans = []
    while sched.has_work:
        if len(plans) == 3:  # first decodes now: a long prompt joins it
            sched.add(second := make_request(prompt=list(range(100, 150)), max_tokens=1))
        plans.append(plan := sched.schedule())
        sched.update(plan, fake_run(plan))
    decoding = [p for p in plans if any(c.request is first and c.num_tokens == 1
                                        for c in p.chunks)]
    assert [c.num_tokens for c in plans[0].chunks] == [32]  # idle: a full chunk
    assert decoding and all(p.num_tokens <= 8 for p in decoding)
    joined = [p for p in decoding if any(c.request is second for c in p.chunks)]
    assert [c.num_tokens for c in joined[0].chunks] == [1, 7]  # the rest of 8 after the decode
    alone = [p for p in plans if p not in decoding and p.chunks[0].request is second]
    assert alone and max(p.num_tokens for p in alone) > 8  # first finished: full chunks again
    sched.assert_drained()


def test_mixed_step_tokens_is_validated() -> None:
    from worker.config import ConfigError, SchedulerConfig

    for bad in (4, 64):  # below max_num_seqs (8), above chunked_prefill_size (32)
        with pytest.raises(ConfigError, match="mixed_step_tokens"):
            SchedulerConfig(max_num_seqs=8, chunked_prefill_size=32,
                            mixed_step_tokens=bad).validate()


def test_a_window_model_needs_each_step_budget_to_hold_its_window() -> None:
    """A worker started by hand (no preflight) refuses a budget its bounded replay overflows."""
    from worker.cache_groups import WindowSpec
    from worker.cache_manager import KVCacheManager
    from worker.config import ConfigError, SchedulerConfig
    from worker.scheduler import Scheduler

    def start(**budgets: int) -> Scheduler:
        cache = KVCacheManager(64, 4, prefix_cache=True, window=WindowSpec(16, 2, 4),
                               num_window_pages=64)
        return Scheduler(SchedulerConfig(max_num_seqs=4, **budgets), cache, max_model_len=512,
                         eos_token_ids=[0], on_output=lambda r: None)

    start(chunked_prefill_size=32, mixed_step_tokens=20)  # 16 + one page of 4 fits
    with pytest.raises(ConfigError, match=r"mixed_step_tokens \(8\) must be at least"):
        start(chunked_prefill_size=32, mixed_step_tokens=8)
    with pytest.raises(ConfigError, match=r"chunked_prefill_size \(16\) must be at least"):
        start(chunked_prefill_size=16)


def test_max_num_seqs_limits_the_batch() -> None:
    sched, _ = make_scheduler(max_num_seqs=2, chunked_prefill_size=64)
    reqs = [make_request(4, max_tokens=3) for _ in range(5)]
    for r in reqs:
        sched.add(r)
    plan = sched.schedule()
    assert len(plan.chunks) == 2
    sched.update(plan, fake_run(plan))
    run_to_completion(sched)
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    sched.assert_drained()


def test_admission_waits_for_free_pages() -> None:
    sched, _ = make_scheduler(num_pages=6, page_size=4, prefix_cache=False)
    big = make_request(16, max_tokens=2)  # 5 pages by the end
    other = make_request(12, max_tokens=2)  # 4 pages: cannot fit beside it
    sched.add(big)
    sched.add(other)
    plan = sched.schedule()
    assert [c.request for c in plan.chunks] == [big]
    sched.update(plan, fake_run(plan))
    run_to_completion(sched)
    assert other.status is RequestStatus.FINISHED_LENGTH
    sched.assert_drained()


def test_preemption_under_page_pressure_requeues_and_recomputes() -> None:
    sched, finished = make_scheduler(
        num_pages=8, page_size=4, chunked_prefill_size=64, prefix_cache=False
    )
    reqs = [make_request(7, max_tokens=12) for _ in range(3)]  # each grows to 19 tokens = 5 pages
    for r in reqs:
        sched.add(r)
    run_to_completion(sched)
    assert sched.num_preemptions > 0
    assert sorted(finished, key=id) == sorted(reqs, key=id)
    for r in reqs:
        assert r.status is RequestStatus.FINISHED_LENGTH and len(r.output_token_ids) == 12
    sched.assert_drained()


def test_request_larger_than_the_cache_fails_with_a_reason() -> None:
    sched, finished = make_scheduler(num_pages=4, page_size=4)
    req = make_request(30, max_tokens=2)
    sched.add(req)
    sched.schedule()
    assert finished == [req] and req.status is RequestStatus.FINISHED_ERROR
    assert "KV cache" in req.error and req.error_code == "invalid"
    sched.assert_drained()


def test_prefix_cache_hit_skips_cached_pages() -> None:
    sched, _ = make_scheduler(page_size=4)
    prompt = list(range(1, 18))  # 17 tokens: 4 full pages + 1
    a = make_request(prompt=prompt, max_tokens=2)
    sched.add(a)
    run_to_completion(sched)
    b = make_request(prompt=prompt[:16] + [99, 98], max_tokens=2)
    sched.add(b)
    plan = sched.schedule()
    assert plan.chunks[0].start == 16 and b.num_cached_tokens == 16
    sched.update(plan, fake_run(plan))
    run_to_completion(sched)
    assert sched.stats().cached_pages > 0
    sched.assert_drained()


def test_fully_cached_prompt_still_computes_its_last_token() -> None:
    sched, _ = make_scheduler(page_size=4)
    prompt = list(range(1, 17))  # exactly 4 pages
    for _ in range(2):
        req = make_request(prompt=prompt, max_tokens=1)
        sched.add(req)
        plan = sched.schedule()
        assert (
            plan.chunks[0].start + plan.chunks[0].num_tokens == 16
            and plan.chunks[0].num_tokens >= 1
        )
        sched.update(plan, fake_run(plan))
        run_to_completion(sched)
    assert req.num_cached_tokens == 12
    sched.assert_drained()


def test_cache_is_evicted_when_pages_are_needed() -> None:
    sched, _ = make_scheduler(num_pages=8, page_size=4)
    for i in range(6):
        sched.add(make_request(prompt=[100 + i] * 12, max_tokens=2))
        run_to_completion(sched)
    stats = sched.stats()
    assert stats.free_pages + stats.cached_pages == 8
    sched.assert_drained()


def test_eos_and_stop_tokens_and_min_tokens() -> None:
    sched, _ = make_scheduler(eos=(5,))
    eos_req = make_request(6, max_tokens=10, ignore_eos=False)
    sched.add(eos_req)
    run_to_completion(sched)
    assert eos_req.status is RequestStatus.FINISHED_STOPPED and eos_req.output_token_ids == [5]
    min_req = make_request(6, max_tokens=10, ignore_eos=False, min_tokens=3)
    sched.add(min_req)
    run_to_completion(sched)
    assert min_req.output_token_ids == [5, 5, 5]
    stop_req = make_request(6, max_tokens=10, stop_token_ids=(5,))
    sched.add(stop_req)
    run_to_completion(sched)
    assert stop_req.status is RequestStatus.FINISHED_STOPPED
    sched.assert_drained()


def test_context_limit_finishes_with_length() -> None:
    sched, _ = make_scheduler(max_model_len=12)
    req = make_request(10, max_tokens=100)
    sched.add(req)
    run_to_completion(sched)
    assert req.status is RequestStatus.FINISHED_LENGTH and req.num_tokens == 12
    sched.assert_drained()


@pytest.mark.parametrize("when", ["waiting", "mid_prefill", "decoding", "during_step"])
def test_abort_at_every_state_frees_pages(when: str) -> None:
    sched, finished = make_scheduler(chunked_prefill_size=8, page_size=4)
    req = make_request(20, max_tokens=50)
    bystander = make_request(5, max_tokens=3)
    sched.add(bystander)
    sched.add(req)
    plan = None
    if when != "waiting":
        plan = sched.schedule()
        sched.update(plan, fake_run(plan))
    if when in ("decoding", "during_step"):
        while not req.output_token_ids:
            plan = sched.schedule()
            sched.update(plan, fake_run(plan))
    if when == "during_step":
        plan = sched.schedule()
        assert sched.abort(req.request_id)
        sched.update(plan, fake_run(plan))  # the step that was running when the abort came
    else:
        assert sched.abort(req.request_id)
    assert req.status is RequestStatus.FINISHED_ABORTED and req in finished
    assert not sched.abort(req.request_id)  # idempotent
    run_to_completion(sched)
    sched.assert_drained()


def test_many_mixed_requests_under_pressure_never_leak() -> None:
    sched, finished = make_scheduler(
        num_pages=24, page_size=4, max_num_seqs=6, chunked_prefill_size=24
    )
    reqs = [
        make_request(
            prompt=[1, 2, 3, 4, 5, 6, 7, 8] + [i % 7 + 10] * (i % 11 + 1), max_tokens=i % 9 + 1
        )
        for i in range(40)
    ]
    for i, r in enumerate(reqs):
        sched.add(r)
        if i % 5 == 0:
            sched.update(plan := sched.schedule(), fake_run(plan))
    sched.abort(reqs[3].request_id)
    run_to_completion(sched)
    assert len(finished) == 40
    assert all(r.status.is_finished for r in reqs)
    sched.assert_drained()
