"""Multi-rank workers on two GPUs, for real (NCCL): the CPU tests' layouts with device cuda.

TP=2 (dense), attention DP=2 with EP=2 and with MoE TP (Qwen3-MoE), each an `Engine` whose
second rank is a spawned process on cuda:1, must give the one-GPU engine's greedy tokens and
give every page back — eagerly, and with decode graphs captured on both ranks (the followers
replay each bucket on GRAPH_STEP / DP_GRAPH_STEP; the MoE blocks on their static path).
Skipped unless two GPUs (and triton) are present.
"""

from __future__ import annotations

import importlib.util
import os
import random
from pathlib import Path

import pytest
import torch

from models.make_tiny_moe import make_tiny_moe
from tests.worker.test_engine import generate
from worker.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2 or importlib.util.find_spec("triton") is None,
                       reason="needs two CUDA GPUs and triton"),
]

# NVLink multicast stays off on the lent machines (their notes say why).
for _var, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_var, _value)


def _engine(path: Path, tp: int = 1, dp: int = 1, ep: int = 1) -> Engine:
    return Engine(WorkerConfig(
        model=ModelConfig(path=str(path), dtype="float32", enforce_eager=True),
        cache=CacheConfig(page_size=4, num_pages=96),
        scheduler=SchedulerConfig(max_num_seqs=4, chunked_prefill_size=16),
        parallel=ParallelConfig(tp_size=tp, dp_size=dp, ep_size=ep, device="cuda"),
    ))


def _check(path: Path, graphs: bool, **layout: int) -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(97) for _ in range(rng.randrange(3, 30))] for _ in range(7)]
    ref = _engine(path)  # one GPU, eager: the reference
    want = generate(ref, prompts, max_tokens=10)
    eng = _engine(path, **layout)
    try:
        if graphs:
            eng.enable_decode_graphs()
        # with DP: group 1 idles on empty batches (eager) or all-padding buckets (graphs)
        assert generate(eng, prompts[:1], max_tokens=10) == want[:1]
        assert generate(eng, prompts, max_tokens=10) == want
        if graphs:
            captured = eng.dp.graphs if eng.dp is not None else eng.runner.decode_graphs
            assert captured is not None and captured.replays and captured.num_replays > 10
        for sched in eng.schedulers:
            assert sched.stats().used_pages == 0
    finally:
        eng.close()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_dense_tp2_equals_one_gpu(graphs: bool, tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("qwen3")
    _check(path, graphs, tp=2)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("ep", [2, 1], ids=["ep2", "moe-tp"])
def test_moe_dp2_equals_one_gpu(ep: int, graphs: bool, tmp_path: Path) -> None:
    make_tiny_moe(tmp_path / "moe")
    _check(tmp_path / "moe", graphs, dp=2, ep=ep)


def test_moe_tp2_ep2_graphs_equal_one_gpu(tmp_path: Path) -> None:
    make_tiny_moe(tmp_path / "moe")
    _check(tmp_path / "moe", True, tp=2, ep=2)
