"""Attention sinks in the Triton paged kernels, against the torch reference (TorchSDPABackend).

Run on CUDA; with `TRITON_INTERPRET=1` and triton installed they also run on CPU tensors (how
the kernels were checked without a GPU):
    TRITON_INTERPRET=1 .venv/bin/pytest -q tests/worker/test_gpt_oss_kernels.py
The caches are the strided per-layer views of a real `KVCache` (non-contiguous pages, padding
page 0 filled with NaN), so a kernel that reads a wrong page or row fails. The GPU-only test
replays the decode kernel with sinks inside a CUDA graph.
"""

from __future__ import annotations

import importlib.util
import os
import random

import pytest
import torch

from tests.worker.interpreter import run_interpreted
from worker.batch import ForwardBatch
from worker.kv_cache import KVCache, KVShape
from worker.model.attention import TorchSDPABackend

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_GPU = torch.cuda.is_available() and HAS_TRITON
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and HAS_TRITON
DEVICE = "cuda" if HAS_GPU else "cpu"
kernels = pytest.mark.skipif(
    not (HAS_GPU or INTERPRET), reason="needs CUDA and triton (or TRITON_INTERPRET=1)"
)
PAGE, HQ, HKV, D = 4, 4, 2, 16


def _batch(
    lens: list[tuple[int, int]], seed: int
) -> tuple[ForwardBatch, KVCache, torch.Tensor, torch.Tensor]:
    """Requests as (cached tokens, new tokens): a paged cache holding every token's K/V, q of the
    new tokens, and the batch. Returns (batch, kv, q [T, Hq, D], sinks [Hq])."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = 1 + sum(-(-(c + n) // PAGE) for c, n in lens)
    kv = KVCache(KVShape(num_pages, 1, HKV, PAGE, D, torch.float32), DEVICE)
    kv.data[0] = float("nan")  # page 0 is the page-table padding: never read
    free = list(range(1, num_pages))
    random.Random(seed).shuffle(free)
    k_cache, v_cache = kv.layer(0)
    tables, qs, seq_lens, positions = [], [0], [], []
    for cached, new in lens:
        total = cached + new
        pages = [free.pop() for _ in range(-(-total // PAGE))]
        tables.append(pages)
        for p in range(total):
            k_cache[pages[p // PAGE], :, p % PAGE] = torch.randn(HKV, D, generator=gen).to(DEVICE)
            v_cache[pages[p // PAGE], :, p % PAGE] = torch.randn(HKV, D, generator=gen).to(DEVICE)
        qs.append(qs[-1] + new)
        seq_lens.append(total)
        positions += range(cached, total)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=DEVICE)
    t = qs[-1]
    batch = ForwardBatch(
        input_ids=torch.zeros(t, dtype=torch.int64, device=DEVICE),
        positions=torch.tensor(positions, device=DEVICE),
        query_start=torch.tensor(qs, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, device=DEVICE),
        page_table=table,
        slot_mapping=torch.full((t,), -1, dtype=torch.int64, device=DEVICE),  # K/V already stored
        logits_indices=torch.tensor(qs[1:], device=DEVICE) - 1,
        query_start_list=qs,
        seq_lens_list=seq_lens,
    )
    q = torch.randn(t, HQ, D, generator=gen).to(DEVICE)
    sinks = (torch.randn(HQ, generator=gen) * 2).to(DEVICE)
    return batch, kv, q, sinks


def _reference(
    batch: ForwardBatch,
    kv: KVCache,
    q: torch.Tensor,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    k_cache, v_cache = kv.layer(0)
    empty = q.new_empty(0, HKV, D)
    return TorchSDPABackend().forward(
        q, empty, empty, k_cache, v_cache, batch, D**-0.5, window, kv_stored=True, sinks=sinks
    )


@kernels
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_kernel_with_sinks_equals_reference(window: int | None, splits: int) -> None:
    from worker.model.triton_decode import triton_paged_decode

    batch, kv, q, sinks = _batch([(0, 1), (4, 1), (20, 1), (37, 1)], seed=1)
    k_cache, v_cache = kv.layer(0)
    for s in (sinks, None):
        got = triton_paged_decode(
            q,
            k_cache,
            v_cache,
            batch.page_table,
            batch.seq_lens,
            D**-0.5,
            window,
            num_splits=splits,
            sinks=s,
        )
        want = _reference(batch, kv, q, window, s)
        assert float((got - want).abs().max()) < 1e-4, f"sinks={s is not None}"
    # The sinks matter: a large sink pulls every output towards zero.
    big = torch.full_like(sinks, 30.0)
    got = triton_paged_decode(
        q,
        k_cache,
        v_cache,
        batch.page_table,
        batch.seq_lens,
        D**-0.5,
        window,
        num_splits=splits,
        sinks=big,
    )
    assert float(got.abs().max()) < 1e-6


_EMPTY_SPLITS = """
import torch
from tests.worker.test_gpt_oss_kernels import D, _batch, _reference
from worker.model.triton_decode import triton_paged_decode

real_empty = torch.empty

def poisoned(*args, **kwargs):  # the split partials' buffers start as NaN, not as zeros
    t = real_empty(*args, **kwargs)
    return t.fill_(float("nan")) if t.dtype == torch.float32 else t

# 1- to 38-token contexts over 8 splits: most splits of the short ones hold nothing
batch, kv, q, sinks = _batch([(0, 1), (4, 1), (20, 1), (37, 1)], seed=2)
k_cache, v_cache = kv.layer(0)
for window in (None, 6):
    for s in (sinks, None):
        torch.empty = poisoned
        try:
            got = triton_paged_decode(q, k_cache, v_cache, batch.page_table, batch.seq_lens,
                                      D**-0.5, window, num_splits=8, sinks=s)
        finally:
            torch.empty = real_empty
        want = _reference(batch, kv, q, window, s)
        err = float((got - want).abs().max())
        assert err < 1e-4, (window, s is not None, err)
"""


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_decode_merge_reads_only_the_splits_that_held_tokens_under_the_interpreter() -> None:
    """Splits past a short context write nothing and the merge reads nothing of them (their
    partial rows are never written): with those buffers poisoned, outputs still match."""
    run_interpreted(_EMPTY_SPLITS)


@kernels
@pytest.mark.parametrize("window", [None, 6])
def test_prefill_kernel_with_sinks_equals_reference(window: int | None) -> None:
    from worker.model.triton_prefill import triton_paged_prefill

    # Fresh prompts, chunks after a cached prefix (longer than a program's 32 rows), decodes.
    lens = [(0, 7), (9, 40), (0, 1), (33, 1), (5, 3), (0, 70)]
    batch, kv, q, sinks = _batch(lens, seed=2)
    k_cache, v_cache = kv.layer(0)
    longest = max(n for _, n in lens)
    for s in (sinks, None):
        got = triton_paged_prefill(
            q,
            k_cache,
            v_cache,
            batch.page_table,
            batch.query_start,
            batch.seq_lens,
            longest,
            D**-0.5,
            window,
            s,
        )
        want = _reference(batch, kv, q, window, s)
        assert float((got - want).abs().max()) < 1e-4, f"sinks={s is not None}"


@kernels
def test_backend_mixed_step_with_sinks_uses_the_prefill_kernel() -> None:
    from worker.model.triton_attention import TritonPagedBackend

    batch, kv, q, sinks = _batch([(3, 5), (12, 1), (0, 9)], seed=3)
    k_cache, v_cache = kv.layer(0)
    empty = q.new_empty(0, HKV, D)
    got = TritonPagedBackend().forward(
        q, empty, empty, k_cache, v_cache, batch, D**-0.5, 6, kv_stored=True, sinks=sinks
    )
    assert float((got - _reference(batch, kv, q, 6, sinks)).abs().max()) < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs CUDA and triton")
def test_decode_with_sinks_replays_in_a_cuda_graph() -> None:
    """The sinks are read through a fixed pointer: a captured decode replays with new inputs."""
    from worker.model.triton_decode import triton_paged_decode

    batch, kv, q, sinks = _batch([(10, 1), (30, 1)], seed=4)
    k_cache, v_cache = kv.layer(0)
    static_q = q.clone()
    triton_paged_decode(
        static_q, k_cache, v_cache, batch.page_table, batch.seq_lens, D**-0.5, 6, sinks=sinks
    )
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_paged_decode(
            static_q, k_cache, v_cache, batch.page_table, batch.seq_lens, D**-0.5, 6, sinks=sinks
        )
    for step in range(3):
        static_q.copy_(torch.randn_like(q))
        sinks.add_(step)  # parameters change in place (a reload): the graph sees the new values
        graph.replay()
        # bf16 values, float32 sums in another order than the reference's: a few 1e-3 apart
        assert float((out - _reference(batch, kv, static_q, 6, sinks)).abs().max()) < 3e-3


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs CUDA and triton")
@pytest.mark.parametrize("window", [8, 256])  # 8: rings (window_attention); 256: never slides
def test_gpt_oss_engine_on_gpu_equals_the_cpu_engine(tmp_path, window: int) -> None:  # noqa: ANN001
    """The whole GPU path (Triton decode and prefill kernels with sinks, fused norms, the window
    rings on GPU) gives the CPU reference engine's greedy tokens, and drains."""
    from tests.worker.gpt_oss_model import build_gpt_oss_checkpoint
    from tests.worker.test_engine import generate
    from worker.config import (
        CacheConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        WorkerConfig,
    )
    from worker.engine import Engine

    build_gpt_oss_checkpoint(tmp_path, sliding_window=window)
    rng = random.Random(9)
    prompts = [[rng.randrange(1, 128) for _ in range(n)] for n in (5, 17, 40, 61)]

    def engine(device: str) -> Engine:
        return Engine(
            WorkerConfig(
                model=ModelConfig(path=str(tmp_path), dtype="float32"),
                cache=CacheConfig(page_size=4, num_pages=256),
                scheduler=SchedulerConfig(max_num_seqs=8, chunked_prefill_size=16),
                parallel=ParallelConfig(device=device),
            )
        )

    want = generate(engine("cpu"), prompts, max_tokens=12)
    gpu_engine = engine("cuda")
    assert (gpu_engine.kv.shape.window_layers != ()) == (window == 8)
    assert generate(gpu_engine, prompts, max_tokens=12) == want
    gpu_engine.scheduler.assert_drained()


@kernels
def test_gpt_oss_model_on_the_triton_backend_equals_transformers(
    tmp_path,  # noqa: ANN001
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every layer through TritonPagedBackend (prefill and decode kernels, sinks, the sliding
    layers' window mask) in the model: transformers' logits. CPU tensors under the
    interpreter, or CUDA."""
    from worker.model import attention, triton_attention

    if not HAS_GPU:
        # Triton 3.9's interpreter rejects the store kernel's broadcast mask ("mask has
        # unsupported dtype"); on CUDA the kernel itself runs. Here the K/V go in through the
        # torch store, which writes the same slots, so the attention kernels are what is tested.
        monkeypatch.setattr(triton_attention, "triton_store_kv", attention.store_kv)
    from tests.worker.conftest import PagedHarness
    from tests.worker.gpt_oss_model import build_gpt_oss_checkpoint
    from worker.config import ModelConfig, ParallelConfig
    from worker.model import load_model
    from worker.model.gpt_oss import GptOssAttention
    from worker.model.triton_attention import TritonPagedBackend

    hf = build_gpt_oss_checkpoint(tmp_path)
    model, spec = load_model(ModelConfig(path=str(tmp_path)), ParallelConfig())
    backend = TritonPagedBackend()
    for module in model.modules():
        if isinstance(module, GptOssAttention):
            module.backend = backend
    ids = [random.Random(3).randrange(128) for _ in range(30)]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0][[12, 27, 28, 29]]
    harness = PagedHarness(model, spec)  # no rings: the sliding layers mask their window
    rows = [harness.step([("r", ids[:13])]), harness.step([("r", ids[13:-2])])]
    rows += [harness.step([("r", [t])]) for t in ids[-2:]]
    assert float((torch.cat(rows) - want).abs().max()) < 1e-4
