"""Speculative decoding on CUDA: verify steps replayed as CUDA graphs (B x (k + 1) shapes).

Skipped where CUDA or triton is missing (the lead runs them on an H200). The CPU side of the
same padding is checked by tests/worker/test_spec_models.py (`VerifyGraphs.eager`).
"""

from __future__ import annotations

import importlib.util
import os
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
@pytest.mark.parametrize("method", ["eagle", "ngram", "draft"])
def test_verify_graphs_replay_what_the_eager_verify_computes(method: str) -> None:
    """Verify steps (and a model drafter's draft steps) as graphs give the eager output."""
    prompts = _prompts()
    eager = Engine(_config(method))
    want = _generate(eager, prompts, _greedy)
    graphed = Engine(_config(method))
    graphed.warm_up()  # captures decode, verify and draft graphs after the warm-up request
    verify = graphed.runner.verify_graphs
    assert verify is not None and verify.width == 4
    got = _generate(graphed, prompts, _greedy)
    assert verify.num_replays > 0
    drafter = graphed.runner.drafter
    if drafter is not None:
        assert drafter.graphs is not None and drafter.graphs.num_replays > 0
        assert drafter.catch_up_graphs is not None and drafter.catch_up_graphs.num_replays > 0
    assert got == want
    assert _generate(Engine(_config("none")), prompts, _greedy) == want  # lossless on CUDA too
    graphed.scheduler.assert_drained()


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton")
kernels = pytest.mark.skipif(not (HAS_GPU or INTERPRET),
                             reason="needs CUDA and triton (or TRITON_INTERPRET=1)")


@kernels
def test_uniform_verify_rows_attend_as_the_reference_does() -> None:
    """The CUDA backend's verify path (`uniform_query_len`: one paged kernel over device
    tensors) on a padded verify batch as VerifyGraphs lays it out: 3 requests x w = 4 rows with
    1, 3 and 4 real tokens; the real rows equal the reference over the unpadded step."""
    from worker.batch import ForwardBatch
    from worker.model.attention import paged_attention
    from worker.model.triton_attention import TritonPagedBackend

    device = "cuda" if HAS_GPU else "cpu"
    torch.manual_seed(0)
    page, hq, hkv, d, w = 16, 4, 2, 32, 4
    starts, reals, pages = [5, 20, 33], [1, 3, 4], [[3], [7, 1], [2, 9, 4]]
    k_cache = torch.randn(12, hkv, page, d, device=device)
    v_cache = torch.randn(12, hkv, page, d, device=device)
    width = 4
    table = torch.tensor([p + [0] * (width - len(p)) for p in pages], device=device)
    rows = [i * w + j for i, n in enumerate(reals) for j in range(n)]
    q = torch.randn(3 * w, hq, d, device=device)
    k = torch.randn(3 * w, hkv, d, device=device)
    v = torch.randn(3 * w, hkv, d, device=device)

    def slot(i: int, p: int) -> int:
        return pages[i][p // page] * page + p % page

    slots = [slot(i, s + j) if j < reals[i] else -1 for i, s in enumerate(starts)
             for j in range(w)]
    padded = ForwardBatch(
        input_ids=torch.zeros(3 * w, dtype=torch.int64, device=device),
        positions=torch.tensor([s + j for s in starts for j in range(w)], device=device),
        query_start=torch.arange(0, 4 * w, w, device=device),
        seq_lens=torch.tensor([s + w for s in starts], device=device), page_table=table,
        slot_mapping=torch.tensor(slots, device=device),
        logits_indices=torch.arange(3 * w, device=device),
        query_start_list=[0, w, 2 * w, 3 * w], seq_lens_list=[s + w for s in starts],
        uniform_query_len=w)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    got = TritonPagedBackend().forward(q, k, v, k_cache, v_cache, padded, d**-0.5)[rows]
    qs = [0]
    for n in reals:
        qs.append(qs[-1] + n)
    plain = ForwardBatch(
        input_ids=torch.zeros(len(rows), dtype=torch.int64, device=device),
        positions=torch.tensor([s + j for s, n in zip(starts, reals, strict=True)
                                for j in range(n)], device=device),
        query_start=torch.tensor(qs, device=device),
        seq_lens=torch.tensor([s + n for s, n in zip(starts, reals, strict=True)], device=device),
        page_table=table, slot_mapping=torch.tensor([slots[r] for r in rows], device=device),
        logits_indices=torch.tensor(qs[1:], device=device) - 1, query_start_list=qs,
        seq_lens_list=[s + n for s, n in zip(starts, reals, strict=True)])
    want = paged_attention(q[rows], k[rows], v[rows], ref_k, ref_v, plain, d**-0.5)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(k_cache, ref_k)  # the padding rows stored nothing
