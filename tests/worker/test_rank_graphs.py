"""Decode graphs on multi-rank workers, the protocol for real (gloo, spawned rank processes).

On a CPU `DecodeGraphs` runs each "replay" as an eager forward over its static buffers, so the
multi-rank graph protocol runs here exactly as on GPUs except for the capture itself: rank 0
sends CAPTURE (every follower builds the same buckets), then every pure-decode step fills the
flat inputs once and sends them (GRAPH_STEP for TP, DP_GRAPH_STEP with every group's inputs for
attention DP); every rank replays the same bucket, and the MoE blocks take their static-shape
path (fixed-capacity all-to-alls). Greedy tokens must equal a one-rank eager engine's, steps
must really have gone through the graphs, and every page must come back.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from models.make_tiny_moe import make_tiny_moe
from tests.worker.test_engine import generate
from worker.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, WorkerConfig
from worker.cuda_graphs import DecodeGraphs
from worker.engine import Engine


def _engine(path: Path, tp: int = 1, dp: int = 1, ep: int = 1) -> Engine:
    return Engine(WorkerConfig(
        model=ModelConfig(path=str(path), dtype="float32"),
        cache=CacheConfig(page_size=4, num_pages=96),
        scheduler=SchedulerConfig(max_num_seqs=6, chunked_prefill_size=16),
        parallel=ParallelConfig(tp_size=tp, dp_size=dp, ep_size=ep),
        num_threads=1,
    ))


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(97) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


def _graphs(eng: Engine) -> DecodeGraphs:
    graphs = eng.dp.graphs if eng.dp is not None else eng.runner.decode_graphs
    assert graphs is not None and not graphs.replays  # CPU: eager steps over static buffers
    return graphs


def _check(path: Path, **layout: int) -> None:
    prompts = _prompts(7, seed=5)
    ref = _engine(path)
    want_alone, want = generate(ref, prompts[:1], max_tokens=6), generate(ref, prompts, 12)
    eng = _engine(path, **layout)
    try:
        eng.enable_decode_graphs()
        graphs = _graphs(eng)
        assert generate(eng, prompts[:1], max_tokens=6) == want_alone  # DP: group 1 idles
        alone = graphs.num_replays
        assert alone == 5, "every decode step of one request replayed a bucket"
        assert generate(eng, prompts, max_tokens=12) == want  # several buckets, mixed steps
        assert graphs.num_replays > alone + 5
        for sched in eng.schedulers:
            assert sched.stats().used_pages == 0
            sched.assert_drained()
    finally:
        eng.close()
    assert eng.tp is not None and all(not p.is_alive() for p in eng.tp.procs)


def test_tp2_dense_graph_steps_equal_one_rank(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("qwen3")
    _check(path, tp=2)


@pytest.mark.parametrize("ep", [2, 1], ids=["ep2", "moe-tp"])
def test_dp2_moe_graph_steps_equal_one_rank(ep: int, tmp_path: Path) -> None:
    make_tiny_moe(tmp_path / "moe")
    _check(tmp_path / "moe", dp=2, ep=ep)


def test_tp2_ep2_moe_graph_steps_equal_one_rank(tmp_path: Path) -> None:
    """Attention TP with EP: each rank dispatches its padded slice of the batch."""
    make_tiny_moe(tmp_path / "moe")
    _check(tmp_path / "moe", tp=2, ep=2)


def test_a_follower_refuses_a_graph_step_before_capture(tiny_checkpoint) -> None:
    """The input prefix names its bucket: a length no bucket has is refused, not guessed."""
    path, _ = tiny_checkpoint("qwen3")
    eng = _engine(path)
    graphs = DecodeGraphs(eng.model, eng.kv, max_num_seqs=6, max_model_len=64)
    graphs.capture()
    assert graphs.buckets == [1, 2, 4, 6]
    assert [graphs.bucket_of_len(graphs.used_len(b)) for b in graphs.buckets] == graphs.buckets
    with pytest.raises(AssertionError, match="no graph for an input prefix"):
        graphs.bucket_of_len(graphs.used_len(3))
    with torch.inference_mode():
        assert graphs.replay(2).shape == (2, 97)
