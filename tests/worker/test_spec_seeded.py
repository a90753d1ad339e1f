"""Seeded sampling with drafts is reproducible whatever shares the step.

A seeded request's draws come from its own generator: a model drafter draws each sampled draft
from it, and the verify draws one uniform per draft checked plus the token after (from the
residual of a rejected draft, or from the row after the last one when all are accepted). So the
tokens depend on how many drafts the request got at each step, and that number must not depend
on the other requests in the step (their use of the step's token budget): else the same request
gives other tokens under load, and mono (prompt chunks share the budget) differs from PD's decode.

The drafter here is the target itself (`method: draft` pointed at the checkpoint), so q == p and
every draft is accepted: each step's bonus draw lands where the number of drafts says.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.worker.conftest import build_tiny_checkpoint
from worker.config import (
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    WorkerConfig,
)
from worker.engine import Engine, RequestOutput
from worker.request import Request
from worker.sampling import SamplingParams


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("seeded") / "llama"
    build_tiny_checkpoint(path, "llama", seed=53, max_position_embeddings=256)
    return path


def _engine(path: Path, k: int, budget: int) -> Engine:
    return Engine(WorkerConfig(
        model=ModelConfig(path=str(path)),
        scheduler=SchedulerConfig(max_num_seqs=4, chunked_prefill_size=budget),
        speculative=SpeculativeConfig(method="draft", num_speculative_tokens=k, model=str(path)),
    ))


def _run(engine: Engine, prompts: list[list[int]],
         params: Callable[[int], SamplingParams]) -> list[list[int]]:
    outs: dict[str, list[int]] = {}

    def sink(o: RequestOutput) -> None:
        outs.setdefault(o.request_id, []).extend(o.token_ids)

    for i, p in enumerate(prompts):
        engine.submit(Request(f"r{i}", p, params(i)), sink)
    while engine.step() or engine.has_pending_work():
        pass
    engine.scheduler.assert_drained()
    return [outs.get(f"r{i}", []) for i in range(len(prompts))]


# 16: three drafts a seeded request (16 // 4 seats - 1), the step shared; 8: one, a budget
# below k + 1 (each request's drafts as k = 8 would be cut anyway).
@pytest.mark.parametrize("budget", [16, 8], ids=["budget-shared", "budget-below-k"])
def test_a_seeded_request_samples_the_same_alone_and_under_load(
        checkpoint: Path, budget: int) -> None:
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 97) for _ in range(n)] for n in (9, 23, 14, 30)]

    def params(i: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=100 + i, max_tokens=24, ignore_eos=True)

    engine = _engine(checkpoint, k=8, budget=budget)
    alone = [_run(engine, [p], lambda _, i=i: params(i))[0]  # type: ignore[misc]
             for i, p in enumerate(prompts)]
    together = _run(engine, prompts, params)  # the four share each step's budget
    assert engine.spec_counters.accepted > 0  # drafts really ran
    assert together == alone


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_a_seeded_request_samples_the_same_when_preempted(checkpoint: Path, method: str) -> None:
    # Preempted, a request recomputes its prompt and output; its last token then decodes with
    # its drafts as it would have, so its generator's draws line up with a run without
    # preemption (a recompute that sampled that token itself would draw once, not per draft).
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 97) for _ in range(n)] for n in (20, 25, 30, 22)]

    def run(num_pages: int) -> tuple[list[list[int]], int]:
        engine = Engine(WorkerConfig(
            model=ModelConfig(path=str(checkpoint)),
            cache=CacheConfig(page_size=4, num_pages=num_pages),
            scheduler=SchedulerConfig(max_num_seqs=4, chunked_prefill_size=64),
            speculative=SpeculativeConfig(method=method,  # type: ignore[arg-type]
                                          num_speculative_tokens=4,
                                          model=str(checkpoint) if method == "draft" else ""),
        ))
        outs = _run(engine, prompts, lambda i: SamplingParams(
            temperature=1.0, seed=5 + i, max_tokens=60, ignore_eos=True))
        return outs, engine.scheduler.num_preemptions

    roomy, none = run(400)
    tight, preemptions = run(50)
    assert none == 0 and preemptions > 0
    assert tight == roomy
