"""Speculative decoding on CUDA: verify steps replayed as CUDA graphs (B x (k + 1) shapes).

Skipped where CUDA or triton is missing (the lead runs them on an H200). The CPU side of the
same padding is checked by tests/worker/test_spec_models.py (`VerifyGraphs.eager`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from orchestrator.launch.background import EMBEDDED_MODEL
from tests.worker.test_spec import _generate
from worker.config import (
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    WorkerConfig,
)
from worker.engine import Engine
from worker.sampling import SamplingParams

HAS_GPU = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs CUDA and triton")


def _config(method: str) -> WorkerConfig:
    return WorkerConfig(
        model=ModelConfig(path=str(EMBEDDED_MODEL)),
        cache=CacheConfig(page_size=16, num_pages=256),
        scheduler=SchedulerConfig(max_num_seqs=8, chunked_prefill_size=256),
        parallel=ParallelConfig(device="cuda"),
        speculative=SpeculativeConfig(method=method,  # type: ignore[arg-type]
                                      num_speculative_tokens=3),
    )


def _prompts() -> list[list[int]]:
    from gateway.tokenizer import Tokenizer
    from orchestrator.tasks import arith

    tok = Tokenizer.from_dir(Path(EMBEDDED_MODEL))
    return [tok.encode(p.prompt) for p in arith.make_problems(6, seed=2)]


def _greedy(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=8 + i)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("method", ["eagle", "ngram"])
def test_verify_graphs_replay_what_the_eager_verify_computes(method: str) -> None:
    prompts = _prompts()
    eager = Engine(_config(method))
    want = _generate(eager, prompts, _greedy)
    graphed = Engine(_config(method))
    graphed.warm_up()  # captures decode and verify graphs after the warm-up request
    verify = graphed.runner.verify_graphs
    assert verify is not None and verify.width == 4
    got = _generate(graphed, prompts, _greedy)
    assert verify.num_replays > 0
    assert got == want
    assert _generate(Engine(_config("none")), prompts, _greedy) == want  # lossless on CUDA too
    graphed.scheduler.assert_drained()
