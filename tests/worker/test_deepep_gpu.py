"""DeepEP against the torch all-to-all, EP=2 on two GPUs (NCCL), equal and timed.

Needs two GPUs and DeepEP importable (built by bench/device/build-deepep.sh; PYTHONPATH its
output), so it skips elsewhere. Two spawned ranks hold the same random Qwen3-MoE-style block
(8 experts, top-2, bf16), each its 4 experts, once per `all2all_backend`:
- attention DP layout (each rank its own tokens, different counts, one rank with a single
  token) and attention TP layout (the same tokens on both ranks, each dispatching its slice):
  DeepEP's dispatch / combine gives the torch all-to-all's output (bf16 tolerance);
- timing: the MoE block per backend at 1, 64, 512 and 4096 tokens per rank (median of 20,
  CUDA-synchronized), printed (`pytest -s`) and written to $OUT/deepep_ep2.json when $OUT is set;
- an Engine with DP=2 attention x EP=2 over `all2all_backend: deepep` (Qwen3-MoE, bf16) gives
  the torch backend's greedy tokens and gives every page back.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2 or importlib.util.find_spec("deep_ep") is None,
                       reason="needs two CUDA GPUs and deep_ep (bench/device/build-deepep.sh)"),
]

for _var, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_var, _value)

HIDDEN, INTER, EXPERTS, TOP_K = 256, 512, 8, 2
TIMED_TOKENS = (1, 64, 512, 4096)


def _blocks(rank: int, replicated: bool) -> dict[str, torch.nn.Module]:
    """The same block (seeded) once per backend; this rank loads its experts' slices."""
    from worker.model.moe import MoEParallel, SparseMoEBlock

    g = torch.Generator().manual_seed(0)
    gate = torch.randn(EXPERTS, HIDDEN, generator=g) * 0.3
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.05
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.05
    mine = slice(rank * EXPERTS // 2, (rank + 1) * EXPERTS // 2)
    out = {}
    for backend in ("torch", "deepep"):
        par = MoEParallel(size=2, rank=rank, ep=True, tokens_replicated=replicated, backend=backend)
        block = SparseMoEBlock(HIDDEN, INTER, EXPERTS, TOP_K, True, par, torch.bfloat16)
        block.gate.data.copy_(gate)
        block.w13.data.copy_(w13[mine])
        block.w2.data.copy_(w2[mine])
        out[backend] = block.cuda()
    return out


def _median_ms(fn: Callable[[], object], iters: int = 20) -> float:
    times = []
    for _ in range(iters + 2):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:]) * 1e3


def _rank_main(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=2)
    rel_err: dict[str, float] = {}
    ms: dict[str, float] = {}
    try:
        with torch.no_grad():
            for replicated in (False, True):
                blocks = _blocks(rank, replicated)
                # DP: different counts per rank (one rank a single token); TP: the same tokens
                counts = (37, 1, 128) if rank == 0 else (5, 64, 128)
                for i, t in enumerate(counts):
                    seed = 100 + i if replicated else 10 * rank + i
                    x = torch.randn(t if not replicated else 40 + i, HIDDEN,
                                    generator=torch.Generator().manual_seed(seed))
                    x = x.to(torch.bfloat16).cuda()
                    want, got = blocks["torch"](x), blocks["deepep"](x)
                    rel = float((got - want).float().norm() / want.float().norm())
                    rel_err[f"{'tp' if replicated else 'dp'}-{i}"] = rel
            blocks = _blocks(rank, replicated=False)
            for t in TIMED_TOKENS:
                x = torch.randn(t, HIDDEN, generator=torch.Generator().manual_seed(t))
                x = x.to(torch.bfloat16).cuda()
                for backend, block in blocks.items():
                    ms[f"{backend}-{t}"] = _median_ms(functools.partial(block, x))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"rel_err": rel_err, "ms": ms}))
    finally:
        dist.destroy_process_group()


def test_deepep_dispatch_combine_equals_torch_all_to_all(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, rep in enumerate(reports):
        for case, rel in rep["rel_err"].items():
            assert rel < 2e-2, f"rank {rank} {case}: |deepep - torch| / |torch| = {rel}"
    lines = ["| tokens per rank | torch all-to-all ms | DeepEP ms | torch / DeepEP |",
             "|---|---|---|---|"]
    for t in TIMED_TOKENS:
        ms_t = max(rep["ms"][f"torch-{t}"] for rep in reports)
        ms_d = max(rep["ms"][f"deepep-{t}"] for rep in reports)
        lines.append(f"| {t} | {ms_t:.3f} | {ms_d:.3f} | {ms_t / ms_d:.2f} |")
    table = "\n".join(lines)
    print(f"\nMoE block EP=2 (hidden {HIDDEN}, {EXPERTS} experts top-{TOP_K}, bf16), slower rank:\n"
          + table)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "deepep_ep2.json").write_text(json.dumps(reports, indent=1))
        Path(os.environ["OUT"], "deepep_ep2.md").write_text(table + "\n")


def test_dp2_ep2_engine_over_deepep_equals_the_torch_backend(tmp_path: Path) -> None:
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

    def engine(backend: str) -> Engine:
        return Engine(WorkerConfig(
            model=ModelConfig(path=str(tmp_path / "moe"), dtype="bfloat16", enforce_eager=True),
            cache=CacheConfig(page_size=4, num_pages=96),
            scheduler=SchedulerConfig(max_num_seqs=4, chunked_prefill_size=16),
            parallel=ParallelConfig(dp_size=2, ep_size=2, device="cuda", all2all_backend=backend),
        ))

    rng = random.Random(5)
    prompts = [[rng.randrange(97) for _ in range(rng.randrange(3, 30))] for _ in range(7)]
    results = []
    for backend in ("torch", "deepep"):
        eng = engine(backend)
        try:
            results.append(generate(eng, prompts, max_tokens=8))
            for sched in eng.schedulers:
                assert sched.stats().used_pages == 0
        finally:
            eng.close()
    assert results[1] == results[0]
