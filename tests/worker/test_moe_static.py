"""The MoE block's static-shape path (worker/model/moe_static.py, moe_kernels.py) against eager.

CPU: `align` puts every row with an expert in exactly one block of that expert (padding rows
are R, unused blocks -1); the static block equals the eager one on one rank; the grouped GEMM
kernel under Triton's interpreter (a subprocess with TRITON_INTERPRET=1) equals the per-expert
reference, empty slots (-1) coming out zero. GPU (marker `gpu`): the kernel in bf16 and float32,
a captured CUDA graph of the static block, replayed on new inputs, equal to eager, and a
one-GPU Qwen3-MoE engine with decode graphs giving the eager engine's greedy tokens.
The multi-rank layouts (EP=2 under TP and DP, MoE TP under DP) run inside the engines of
tests/worker/test_rank_graphs.py.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from orchestrator.launch.background import REPO
from worker.model.moe import MoEParallel, SparseMoEBlock, graph_shapes
from worker.model.moe_kernels import align

HAS_GPU = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _block(experts: int = 6, hidden: int = 32, inter: int = 48, top_k: int = 2,
           dtype: torch.dtype = torch.float32, device: str = "cpu") -> SparseMoEBlock:
    block = SparseMoEBlock(hidden, inter, experts, top_k, True, MoEParallel(), dtype)
    g = torch.Generator().manual_seed(0)
    for p in (block.gate, block.w13, block.w2):
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return block.to(device)


def _reference(block: SparseMoEBlock, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(rows)
    for i, e in enumerate(ids.tolist()):
        if e >= 0:
            out[i] = block.experts(rows[i : i + 1], ids[i : i + 1])[0]
    return out


def test_align_puts_each_row_in_one_block_of_its_expert() -> None:
    ids = torch.tensor([3, 0, -1, 3, 3, 5, 0, -1, 3, 1])
    sorted_rows, block_expert = align(ids, num_experts=6, block_m=4)
    r = ids.numel()
    assert sorted_rows.numel() == -(-(r + 6 * 3) // 4) * 4  # the static worst case
    seen: list[int] = []
    for b, e in enumerate(block_expert.tolist()):
        rows = [x for x in sorted_rows[4 * b : 4 * b + 4].tolist() if x != r]
        if e < 0:
            assert not rows, "an unused block holds no rows"
            continue
        assert rows and all(int(ids[x]) == e for x in rows)
        seen += rows
    assert sorted(seen) == [i for i, e in enumerate(ids.tolist()) if e >= 0]  # each exactly once
    assert block_expert.tolist() == [0, 1, 3, 5, -1, -1, -1]  # expert 3: four rows, one block


def test_static_block_equals_eager_on_one_rank() -> None:
    block = _block()
    x = torch.randn(7, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = block(x)
        with graph_shapes(block):
            assert block.static_shapes
            got = block(x)
    assert not block.static_shapes, "graph_shapes restores the eager path"
    assert torch.allclose(got, want, atol=1e-6)


def _interpreted_check() -> None:
    """Under TRITON_INTERPRET=1: the grouped SwiGLU over CPU tensors equals the reference."""
    from worker.model.moe_kernels import swiglu_experts

    block = _block()
    g = torch.Generator().manual_seed(2)
    rows = torch.randn(21, 32, generator=g)
    ids = torch.randint(-1, 6, (21,), generator=g)
    with torch.no_grad():
        got = swiglu_experts(rows, ids, block.w13, block.w2)
        want = _reference(block, rows, ids)
    assert torch.allclose(got, want, atol=1e-4), float((got - want).abs().max())
    assert not got[ids < 0].any(), "empty slots come out zero"
    print("interpreted grouped gemm ok")


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_grouped_kernel_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = "from tests.worker.test_moe_static import _interpreted_check as c; c()"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "interpreted grouped gemm ok" in out.stdout


gpu = pytest.mark.skipif(not (HAS_GPU and HAS_TRITON), reason="needs CUDA and triton")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_kernel_on_the_gpu(dtype: torch.dtype) -> None:
    from worker.model.moe_kernels import swiglu_experts

    block = _block(experts=8, hidden=256, inter=384, dtype=dtype, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(3)
    rows = torch.randn(77, 256, generator=g, device="cuda").to(dtype)
    ids = torch.randint(-1, 8, (77,), generator=g, device="cuda")
    with torch.no_grad():
        got, want = swiglu_experts(rows, ids, block.w13, block.w2), _reference(block, rows, ids)
    rel = float((got - want).float().norm() / want.float().norm())
    assert rel < (2e-2 if dtype == torch.bfloat16 else 1e-5), rel
    assert not got[ids < 0].any()


@pytest.mark.gpu
@gpu
def test_a_captured_graph_of_the_static_block_equals_eager() -> None:
    """align's sort and counts and the kernel really are capturable: replay on new inputs."""
    block = _block(experts=8, hidden=256, inter=384, device="cuda")
    x = torch.zeros(16, 256, device="cuda")
    with torch.no_grad(), graph_shapes(block):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            block(x)  # warm-up: Triton compiles outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = block(x)
    for seed in (4, 5):
        x.copy_(torch.randn(16, 256, generator=torch.Generator().manual_seed(seed)).cuda())
        graph.replay()
        with torch.no_grad():
            want = block(x)
        # Equal up to float32 summation order (the experts' sums into the output are not
        # ordered between programs): 3.5e-4 apart on the H200, on outputs up to ~120, so the
        # bound is relative to the output's scale, not to each element (some are near 0).
        err, scale = float((y - want).abs().max()), float(want.abs().max())
        assert err <= 1e-5 * scale, (err, scale)


def _check_engine_graphs(tmp_path: Path, device: str) -> None:
    """A one-rank Qwen3-MoE engine with decode graphs gives the eager engine's greedy tokens."""
    import random

    from models.make_tiny_moe import make_tiny_moe
    from tests.worker.test_engine import generate
    from worker.config import (
        CacheConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        WorkerConfig,
    )
    from worker.engine import Engine

    make_tiny_moe(tmp_path / "moe")

    def engine() -> Engine:
        return Engine(WorkerConfig(
            model=ModelConfig(path=str(tmp_path / "moe"), dtype="float32", enforce_eager=True),
            cache=CacheConfig(page_size=4, num_pages=96),
            scheduler=SchedulerConfig(max_num_seqs=4, chunked_prefill_size=16, overlap="off"),
            parallel=ParallelConfig(device=device),
            num_threads=1,
        ))

    rng = random.Random(5)
    prompts = [[rng.randrange(97) for _ in range(rng.randrange(3, 30))] for _ in range(6)]
    want = generate(engine(), prompts, max_tokens=10)
    eng = engine()
    eng.enable_decode_graphs()
    assert generate(eng, prompts, max_tokens=10) == want
    graphs = eng.runner.decode_graphs
    assert graphs is not None and graphs.replays == (device == "cuda")
    assert graphs.num_replays > 5
    assert eng.scheduler.stats().used_pages == 0


def test_one_rank_moe_engine_graph_steps_equal_eager(tmp_path: Path) -> None:
    """On a CPU the graph steps run eagerly over the static buffers, MoE on its static path."""
    _check_engine_graphs(tmp_path, "cpu")


@pytest.mark.gpu
@gpu
def test_one_gpu_moe_engine_with_graphs_equals_eager(tmp_path: Path) -> None:
    """Qwen3-MoE now captures decode graphs on one GPU (the static path inside)."""
    _check_engine_graphs(tmp_path, "cuda")
