"""Whole-step graphs for steps with prompt tokens (worker/mixed_graphs.py): the static batch's
attention split (decode rows, prefill requests, padding of both) gives the eager split's hidden
states, steps that do not fit fall back, and an engine with them serves the tokens of one
without.

On CUDA (marked gpu) the graphs are captured and replayed; in CI the same static batches run
eagerly on CPU tensors under Triton's interpreter, in a subprocess.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.worker.interpreter import run_interpreted
from tests.worker.test_gpt_oss_kernels import HAS_TRITON
from tests.worker.test_gpu import HAS_GPU, tiny_gpu_engine_setup


def check_engine(path: Path, device: str) -> dict[str, float]:
    """Serve prompts through an engine whose steps with prompt tokens take MixedGraphs (room for
    2 prompts a step, so a step of 3 falls back) and through one without, both overlapping
    their steps; every replayed step's hidden states are checked against the eager Triton
    split of the same step first (its PENDING inputs read from the last step's tokens). Returns
    the figures the caller asserts on."""
    from tests.worker.test_engine import generate
    from worker.config import CacheConfig, ParallelConfig, SchedulerConfig
    from worker.engine import Engine
    from worker.mixed_graphs import MixedGraphs
    from worker.model.attention import AttentionBackend
    from worker.model.triton_attention import TritonPagedBackend
    from worker.step import SchedulePlan

    config, prompts = tiny_gpu_engine_setup(path, "qwen3", seed=3)
    if device == "cpu":
        config = config.__class__(
            model=config.model.__class__(path=config.model.path, dtype="float32"),
            cache=CacheConfig(page_size=4, num_pages=256),
            scheduler=SchedulerConfig(max_num_seqs=4, chunked_prefill_size=32, overlap="on"),
            parallel=ParallelConfig(device="cpu"))
        prompts = [p[:10] for p in prompts[:4]] + [list(range(1, 40))]  # one past a chunk
    max_tokens = 2 if device == "cpu" else 3  # interpreted kernels are slow
    want = generate(Engine(config), prompts, max_tokens=max_tokens)
    engine = Engine(config)
    backend = TritonPagedBackend()  # the CUDA backend; on a CPU, interpreted
    for module in engine.model.modules():
        if isinstance(getattr(module, "backend", None), AttentionBackend):
            module.backend = backend  # type: ignore[assignment]
    scheduler = config.scheduler
    graphs = MixedGraphs(engine.model, engine.kv, scheduler.chunked_prefill_size,
                         scheduler.max_num_seqs, 128, max_prefills=2)
    graphs.capture()
    engine.runner.mixed_graphs = graphs
    errors: list[float] = []
    fallbacks, overlapped = [0], [0]
    replay, bucket_for = graphs.run, graphs.bucket_for

    def checked(chunks, bs, prev_tokens=None, src_rows=None):  # type: ignore[no-untyped-def]
        batch = engine.runner.build_batch(SchedulePlan(chunks=list(chunks)))
        if prev_tokens is not None:  # an overlapped step: PENDING inputs from the last one's
            overlapped[0] += 1
            src = torch.tensor(src_rows, device=batch.input_ids.device)
            ids = torch.where(src >= 0, prev_tokens[src.clamp(min=0)], batch.input_ids)
            batch = dataclasses.replace(batch, input_ids=ids)
        eager = engine.model(batch, engine.kv).float()  # stores the same K/V the replay stores
        hidden, rows = replay(chunks, bs, prev_tokens, src_rows)
        errors.append(float((hidden.float() - eager).abs().max()))
        assert rows.tolist() == batch.logits_indices.tolist()
        return hidden, rows

    def counted(chunks):  # type: ignore[no-untyped-def]
        bs = bucket_for(chunks)
        if bs is None and any(c.num_tokens > 1 for c in chunks):
            fallbacks[0] += 1
        return bs

    graphs.run, graphs.bucket_for = checked, counted  # type: ignore[method-assign]
    got = generate(engine, prompts, max_tokens=max_tokens)
    assert got == want
    assert engine.scheduler.stats().used_pages == 0
    return {"replays": graphs.num_replays, "fallbacks": fallbacks[0], "worst": max(errors),
            "overlapped": overlapped[0]}


_INTERPRETED = """
import tempfile
from pathlib import Path
from tests.worker.test_mixed_graphs import check_engine
with tempfile.TemporaryDirectory() as tmp:
    figures = check_engine(Path(tmp) / "q3", "cpu")
print(figures)
assert figures["replays"] >= 3 and figures["fallbacks"] >= 1, figures
assert figures["overlapped"] >= 1, figures
assert figures["worst"] < 1e-4, figures
"""


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_mixed_steps_from_static_rows_under_the_interpreter() -> None:
    run_interpreted(_INTERPRETED, timeout_s=400)


def test_steps_that_do_not_fit_take_another_path() -> None:
    from worker.mixed_graphs import MixedGraphs, mixed_buckets
    from worker.model.triton_attention import PREFILL_KERNEL_CELLS
    from worker.request import Request
    from worker.sampling import SamplingParams
    from worker.step import ScheduledChunk

    kv = SimpleNamespace(shape=SimpleNamespace(page_size=16), data=torch.zeros(1))  # a CPU's
    graphs = MixedGraphs(None, kv, 64, 8, 4096, max_prefills=2)  # type: ignore[arg-type]

    def chunk(start: int, n: int, drafts: list[int] | None = None) -> ScheduledChunk:
        req = Request("r", list(range(start + n)), SamplingParams())
        return ScheduledChunk(req, start, n, sample=True, drafts=drafts or [])

    assert graphs.buckets == [16, 32, 64]
    assert mixed_buckets(512) == [16, 32, 64, 128, 192, 256, 320, 384, 448, 512]
    assert mixed_buckets(300) == [16, 32, 64, 128, 192, 256, 300]
    assert graphs.bucket_for([chunk(5, 1), chunk(0, 20)]) == 32
    assert graphs.bucket_for([chunk(0, 8), chunk(0, 8), chunk(0, 8)]) is None  # 3 > 2 prompts
    assert graphs.bucket_for([chunk(0, 60), chunk(3, 1), chunk(3, 1), chunk(3, 1),
                              chunk(3, 1), chunk(3, 1)]) is None  # 65 tokens
    assert graphs.bucket_for([chunk(9, 1, drafts=[1, 2])]) is None  # a verify step
    long_context = PREFILL_KERNEL_CELLS // 32
    assert graphs.bucket_for([chunk(long_context, 32)]) is None  # SDPA's size
    assert graphs.bucket_for([chunk(0, 2)]) == 16


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs CUDA and triton")
def test_mixed_steps_on_captured_graphs_equal_eager(tmp_path: Path) -> None:
    figures = check_engine(tmp_path / "q3", "cuda")
    assert figures["replays"] >= 3 and figures["worst"] < 0.05, figures
    assert figures["overlapped"] >= 1, figures
