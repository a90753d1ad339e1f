"""Speculative decoding: acceptance rules, and the engine with drafts equal to the engine without.

The statistical test draws many verify steps with fixed seeds and compares the emitted tokens'
empirical distribution with the target's (total variation distance), for a deterministic
drafter and for a random one; a wrong acceptance rule (e.g. accepting every draft, or drawing
the correction from p instead of the residual) moves it far past the bound.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from orchestrator.launch.background import EMBEDDED_MODEL
from orchestrator.tasks import arith
from tests.worker.factories import make_request, make_scheduler
from worker.config import ConfigError, ModelConfig, SpeculativeConfig, WorkerConfig
from worker.engine import Engine, RequestOutput
from worker.request import Request
from worker.sampling import SamplingParams
from worker.spec.verify import accept, target_probs, verify_rows
from worker.step import RunOutput

VOCAB = 6


def test_greedy_acceptance_keeps_drafts_while_they_are_the_argmax() -> None:
    logits = torch.full((4, VOCAB), -5.0)
    for row, best in enumerate([3, 1, 4, 2]):
        logits[row, best] = 5.0
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    assert accept(logits, [3, 1, 4], greedy, None) == [3, 1, 4, 2]  # all accepted + bonus
    assert accept(logits, [3, 0, 4], greedy, None) == [3, 1]  # correction at the mismatch
    assert accept(logits, [0, 1, 4], greedy, None) == [3]


def _tv(samples: Counter[int], probs: torch.Tensor) -> float:
    n = sum(samples.values())
    return 0.5 * sum(abs(samples.get(t, 0) / n - float(probs[t])) for t in range(probs.numel()))


TRIALS = 5000
BOUND = 0.05  # total variation a correct rule stays under at TRIALS draws (noise is ~0.02)


@pytest.mark.parametrize("drafter", ["deterministic", "random"])
def test_rejection_sampling_keeps_the_target_distribution(drafter: str) -> None:
    """The first emitted token follows row 0 of the target; given the first draft was
    accepted, the second follows row 1."""
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 1.5  # two drafts
    params = SamplingParams(temperature=0.8, top_k=5, max_tokens=8)
    p = target_probs(logits, params)
    gen = torch.Generator().manual_seed(1234)
    q = torch.softmax(torch.randn(2, VOCAB), dim=-1)
    first: Counter[int] = Counter()
    second: Counter[int] = Counter()
    for _ in range(TRIALS):
        if drafter == "random":
            drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
            out = accept(logits, drafts, params, gen, draft_probs=q)
        else:
            drafts = [2, 4]
            out = accept(logits, drafts, params, gen)
        first[out[0]] += 1
        if len(out) > 1:  # out[0] was the accepted first draft
            second[out[1]] += 1
    assert _tv(first, p[0]) < BOUND, (first, p[0])
    if drafter == "deterministic":
        assert _tv(second, p[1]) < BOUND, (second, p[1])


def test_the_bound_catches_a_lossy_rule() -> None:
    """Accepting every draft is the classic lossy bug: the same bound must reject it."""
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    p = target_probs(logits, SamplingParams(temperature=1.0, max_tokens=4))
    always = Counter({2: TRIALS})  # what "accept every draft 2" would emit
    assert _tv(always, p[0]) > 4 * BOUND


def test_min_tokens_bans_eos_on_the_rows_before_it() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3)
    rows = verify_rows(torch.zeros(3, VOCAB), params, generated=[4], drafts=[1, 2],
                       eos_token_ids=(0,))
    assert rows[0, 0] == float("-inf") and rows[1, 0] == float("-inf") and rows[2, 0] == 0.0


# ---- the scheduler ---------------------------------------------------------------------------


def test_rejected_drafts_pages_are_freed_at_once() -> None:
    sched, _ = make_scheduler(num_pages=16, page_size=4)
    sched.num_speculative_tokens = 6
    req = make_request(7, max_tokens=20)
    sched.add(req)
    plan = sched.schedule()
    sched.update(plan, RunOutput([5], [None]))  # the prompt: one token out
    plan = sched.schedule()
    (chunk,) = plan.chunks
    assert chunk.max_drafts == 6 and len(req.page_table) == 4  # room for 8 + 6 tokens
    chunk.drafts = [5, 5, 5, 5, 5, 5]
    chunk.num_tokens += 6
    sched.update(plan, RunOutput([5], [None], more_token_ids=[[9]]))  # one accepted, then 9
    assert req.output_token_ids == [5, 5, 9] and req.num_computed_tokens == 9
    assert len(req.page_table) == 3  # pages for the 10 tokens it has; the rest went back
    assert sched.spec_counters.accepted_hist == [0, 1]
    sched.abort(req.request_id)
    sched.assert_drained()


def test_a_stop_token_inside_an_accepted_draft_ends_the_request_there() -> None:
    sched, finished = make_scheduler(num_pages=16, page_size=4, eos=(0,))
    sched.num_speculative_tokens = 3
    req = make_request(5, max_tokens=10, ignore_eos=False)
    sched.add(req)
    sched.update(sched.schedule(), RunOutput([7], [None]))
    plan = sched.schedule()
    plan.chunks[0].drafts = [7, 0, 7]
    plan.chunks[0].num_tokens += 3
    sched.update(plan, RunOutput([7], [None], more_token_ids=[[0, 7, 8]]))
    assert finished == [req] and req.output_token_ids == [7, 7, 0]
    assert req.finish_reason == "stop"
    sched.assert_drained()


def test_drafts_never_pass_max_tokens() -> None:
    sched, _ = make_scheduler(num_pages=16, page_size=4)
    sched.num_speculative_tokens = 8
    req = make_request(4, max_tokens=3)
    sched.add(req)
    sched.update(sched.schedule(), RunOutput([1], [None]))
    assert sched.schedule().chunks[0].max_drafts == 1  # 2 more tokens: 1 draft + 1 emitted
    sched.abort(req.request_id)
    sched.assert_drained()


# ---- the engine --------------------------------------------------------------------------------


def _engine(method: str, k: int = 4, **kw: object) -> Engine:
    spec = SpeculativeConfig(method=method, num_speculative_tokens=k)  # type: ignore[arg-type]
    config = WorkerConfig(model=ModelConfig(path=str(EMBEDDED_MODEL)), speculative=spec,
                          **kw)  # type: ignore[arg-type]
    return Engine(config)


def _generate(
    engine: Engine,
    prompts: list[list[int]],
    params: Callable[[int], SamplingParams],
    abort: frozenset[int] = frozenset(),
) -> list[tuple[list[int], str]]:
    outs: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}

    def sink(o: RequestOutput) -> None:
        outs.setdefault(o.request_id, []).extend(o.token_ids)
        if o.finished:
            reasons[o.request_id] = o.finish_reason

    for i, p in enumerate(prompts):
        engine.submit(Request(f"q{i}", p, params(i)), sink)
    steps = 0
    while engine.step() or engine.has_pending_work():
        steps += 1
        if steps == 3:
            for i in abort:
                engine.abort(f"q{i}")
    return [(outs.get(f"q{i}", []), reasons.get(f"q{i}", "")) for i in range(len(prompts))]


@pytest.fixture(scope="module")
def arith_prompts() -> list[list[int]]:
    from gateway.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(Path(EMBEDDED_MODEL))
    return [tok.encode(p.prompt) for p in arith.make_problems(12, seed=5)]


def test_greedy_with_ngram_equals_greedy_without_token_for_token(
    arith_prompts: list[list[int]],
) -> None:
    # max_tokens varies so some requests end mid-draft; 5 stops on eos inside accepted drafts.
    def params(i: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=4 + i)

    plain = _generate(_engine("none"), arith_prompts, params)
    engine = _engine("ngram")
    # A bucket for 0..k accepted drafts from the start (Prometheus histograms keep their le set)
    assert engine.spec_counters.accepted_hist == [0] * 5
    spec = _generate(engine, arith_prompts, params)
    assert spec == plain
    assert engine.spec_counters.accepted > 0  # the drafts really ran
    assert len(engine.spec_counters.accepted_hist) == 5
    engine.scheduler.assert_drained()


def test_aborts_and_mixed_sampling_with_ngram_leave_nothing(arith_prompts: list[list[int]]) -> None:
    def params(i: int) -> SamplingParams:  # greedy, seeded sampling, and penalties
        if i % 3 == 1:
            return SamplingParams(temperature=0.7, seed=i, max_tokens=12)
        if i % 3 == 2:
            return SamplingParams(temperature=0.0, repetition_penalty=1.2, max_tokens=12)
        return SamplingParams(temperature=0.0, max_tokens=12)

    engine = _engine("ngram", k=3)
    got = _generate(engine, arith_prompts, params, abort=frozenset({0, 4}))
    assert got[0][1] == "abort" and got[4][1] == "abort"
    assert all(reason for _, reason in got)
    again = _generate(_engine("ngram", k=3), arith_prompts, params)
    assert [g for i, g in enumerate(again) if i not in (0, 4)] == [
        g for i, g in enumerate(got) if i not in (0, 4)
    ]  # seeded sampling reproduces
    engine.scheduler.assert_drained()


def test_speculative_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match="speculative.method"):
        SpeculativeConfig(method="medusa").validate()  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=0).validate()


def test_an_idle_engine_counts_no_drafting_time() -> None:
    # The serving loop steps while idle; tandem_spec_draft_seconds_total grew ~1.5 ms a second
    # on an idle mono worker (the drafter's call on empty plans was timed).
    engine = _engine("ngram")
    for _ in range(20):
        assert not engine.step()
    assert engine.spec_counters.draft_seconds == 0.0
