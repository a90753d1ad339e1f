"""Speculative decoding over a model with sliding-window rings (docs/hybrid-cache.md).

A verify step writes the KV of the last token and of every draft into the request's window ring
before it knows which drafts stand. A ring of R slots keeps position p in slot p % R, so the draft
at n + k overwrites position n + k - R, which the next query (n + 1) still reads when it lies
within its window (from n + 2 - W on): a rejected draft would have erased history the window
needs. So drafts a step stop at R - W + 1 on such a model; greedy output stays that of a worker
without speculation for any num_speculative_tokens.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.worker.window_model import WINDOW, build_window_checkpoint
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

PAGE = 4  # rings of 3 pages: 12 slots for a window of 8, so 5 drafts a step at most


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("window-spec") / "hybrid"
    build_window_checkpoint(path, seed=3)
    return path


def _generate(path: Path, method: str, k: int, prompts: list[list[int]]) -> list[list[int]]:
    engine = Engine(WorkerConfig(
        model=ModelConfig(path=str(path)),
        cache=CacheConfig(page_size=PAGE, num_pages=256),
        scheduler=SchedulerConfig(max_num_seqs=4, chunked_prefill_size=64),
        speculative=SpeculativeConfig(method=method, num_speculative_tokens=k),  # type: ignore[arg-type]
    ))
    outs: dict[str, list[int]] = {}

    def sink(o: RequestOutput) -> None:
        outs.setdefault(o.request_id, []).extend(o.token_ids)

    for i, p in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
        engine.submit(Request(f"r{i}", p, params), sink)
    while engine.step() or engine.has_pending_work():
        pass
    engine.scheduler.assert_drained()
    if method != "none":
        assert engine.spec_counters.drafted > 0
    return [outs[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("k", [5, 8, 16])
def test_greedy_with_drafts_past_the_ring_slack_equals_greedy_without(
        checkpoint: Path, k: int) -> None:
    assert WINDOW == 8
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 97) for _ in range(n)] for n in (5, 17, 30)]
    assert _generate(checkpoint, "ngram", k, prompts) == _generate(checkpoint, "none", 0, prompts)
