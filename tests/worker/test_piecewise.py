"""Piecewise CUDA graphs (worker/piecewise.py): steps with prefill chunks replay graphs around
eager attention and give what the eager engine gives; off CUDA the attention seam only passes
through."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.worker.test_gpu import HAS_GPU, tiny_gpu_engine_setup
from worker.piecewise import MIN_BUCKET, PiecewiseGraphs, token_buckets


def test_token_buckets_cover_every_step_size() -> None:
    for max_tokens in (16, 64, 100, 2048):
        buckets = token_buckets(max_tokens)
        assert buckets[0] == MIN_BUCKET and buckets[-1] == max_tokens
        assert buckets == sorted(set(buckets))
        assert all(next(b for b in buckets if b >= t) - t < max(t, MIN_BUCKET)
                   for t in range(1, max_tokens + 1))  # padding at most doubles a step


def test_the_seam_passes_through_outside_capture(tmp_path: Path) -> None:
    """With the seam in place and nothing captured, the CPU engine serves the same tokens."""
    from tests.worker.conftest import build_tiny_checkpoint
    from tests.worker.test_engine import generate
    from worker.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
    from worker.engine import Engine

    build_tiny_checkpoint(tmp_path / "ck", "qwen3")
    config = WorkerConfig(model=ModelConfig(path=str(tmp_path / "ck")),
                          cache=CacheConfig(page_size=4, num_pages=128),
                          scheduler=SchedulerConfig(max_num_seqs=4, chunked_prefill_size=32))
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [5] * 20]
    want = generate(Engine(config), prompts, max_tokens=6)
    seamed = Engine(config)
    pieces = PiecewiseGraphs(seamed.model, seamed.kv, 32)  # wraps the backend; no capture on CPU
    assert generate(seamed, prompts, max_tokens=6) == want
    # A warm-up pass (what capture runs first) splits the forward at every layer's attention.
    from worker.piecewise import _Bucket, _NoGraph

    pieces._warming = True
    pieces.capturing = bucket = _Bucket(pieces=[_NoGraph()])  # type: ignore[list-item]
    hidden = seamed.model(pieces._static_batch(16), seamed.kv)
    num_layers = seamed.kv.shape.num_layers
    assert len(bucket.pieces) == num_layers + 1 and len(bucket.calls) == num_layers
    assert hidden.shape[0] == 16 and pieces._qkv["q"].shape[0] == 32


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs CUDA and triton")
def test_mixed_steps_on_piecewise_graphs_equal_eager(tmp_path: Path) -> None:
    from tests.worker.test_engine import generate
    from worker.engine import Engine

    config, prompts = tiny_gpu_engine_setup(tmp_path / "q3", "qwen3", seed=1)
    want = generate(Engine(config), prompts, max_tokens=24)  # eager throughout
    graphed = Engine(config)
    graphed.runner.enable_cuda_graphs(8, 128)
    graphed.runner.enable_piecewise_graphs(config.scheduler.chunked_prefill_size)
    got = generate(graphed, prompts, max_tokens=24)
    pieces = graphed.runner.piecewise
    assert pieces is not None and pieces.num_replays > 0  # the prompts' chunks went through it
    assert graphed.runner.decode_graphs is not None and graphed.runner.decode_graphs.num_replays
    assert got == want
    assert graphed.scheduler.stats().used_pages == 0
