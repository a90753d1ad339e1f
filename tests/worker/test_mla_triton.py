"""The MLA kernels (worker/model/triton_mla.py) against the decompressed torch reference.

The absorbed decode kernel (q through W_UK into latent space, attention over latent pages, out
through W_UV) must equal the reference that expands every context latent through kv_b_proj, on
shuffled pages with NaN-poisoned unused rows, for 1 and several splits; the store kernel writes
its slots and skips -1; the whole Triton backend on a mixed batch (decodes + a chunked prefill)
equals the reference backend. Runs on CUDA (`gpu` marker) and, with `TRITON_INTERPRET=1` and
triton installed, on CPU tensors through Triton's interpreter:

    TRITON_INTERPRET=1 .venv/bin/pytest tests/worker/test_mla_triton.py -q
"""

from __future__ import annotations

import importlib.util
import os
import random
from pathlib import Path

import pytest
import torch

from worker.arch.deepseek_config import MLAArch
from worker.batch import ForwardBatch
from worker.model.layers import TPInfo
from worker.model.mla import MLAAttention, TorchMLABackend, prefill_decompressed

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_GPU = torch.cuda.is_available() and HAS_TRITON
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and HAS_TRITON
DEVICE = "cuda" if HAS_GPU else "cpu"
kernels = pytest.mark.skipif(
    not (HAS_GPU or INTERPRET), reason="needs CUDA and triton (or TRITON_INTERPRET=1 with triton)"
)
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs CUDA and triton")
# DeepSeek-V3's MLA widths at a small head count (kv_lora 512, rope 64, nope 128, v 128).
V3_MLA = MLAArch(
    q_lora_rank=64,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    rope_interleave=True,
    softmax_scale=192**-0.5,
)
SMALL_MLA = MLAArch(
    q_lora_rank=None,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    rope_interleave=False,
    softmax_scale=24**-0.5,
)


def _attn(mla: MLAArch, heads: int, dtype: torch.dtype, seed: int) -> MLAAttention:
    torch.manual_seed(seed)
    attn = MLAAttention(mla, 64, heads, 0, False, TPInfo(), TorchMLABackend(), dtype)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5)
    return attn.to(DEVICE)


def _pages(seq_lens: list[int], width: int, page: int, dtype: torch.dtype, seed: int):
    """Random latents per request in shuffled pages of a 2-layer pool (so the layer view is
    strided); unused rows NaN. Returns (layer-0 cache view, page_table, per-request latents)."""
    gen = torch.Generator().manual_seed(seed)
    need = [max(1, -(-n // page)) for n in seq_lens]
    num_pages = sum(need) + 4
    pool = torch.full((num_pages, 2, page, width), float("nan"), dtype=dtype)
    order = list(range(1, num_pages))
    random.Random(seed).shuffle(order)
    table = torch.zeros(len(seq_lens), max(need), dtype=torch.int64)
    latents = []
    for i, n in enumerate(seq_lens):
        pages = [order.pop() for _ in range(need[i])]
        table[i, : len(pages)] = torch.tensor(pages)
        lat = torch.randn(n, width, generator=gen).to(dtype)
        for j in range(n):
            pool[pages[j // page], 0, j % page] = lat[j]
        latents.append(lat)
    return pool.to(DEVICE)[:, 0], table.to(DEVICE), latents


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@kernels
@pytest.mark.parametrize("mla", [V3_MLA, SMALL_MLA], ids=["v3-widths", "small"])
def test_absorbed_decode_equals_decompressed_reference(mla: MLAArch) -> None:
    from worker.model.triton_mla import mla_decode_absorbed, triton_mla_decode

    dtype = torch.float32
    heads, page = 20, 16  # 20 heads: two head blocks, the second partly masked
    seq_lens = [1, 15, 16, 33, 70] if INTERPRET else [1, 15, 16, 17, 300, 1100]
    attn = _attn(mla, heads, dtype, seed=2)
    cache, table, _ = _pages(seq_lens, mla.latent_dim, page, dtype, seed=3)
    lens = torch.tensor(seq_lens, device=DEVICE)
    gen = torch.Generator().manual_seed(4)
    q_nope = torch.randn(len(seq_lens), heads, mla.qk_nope_head_dim, generator=gen).to(DEVICE)
    q_pe = torch.randn(len(seq_lens), heads, mla.qk_rope_head_dim, generator=gen).to(DEVICE)
    with torch.no_grad():
        ref = torch.cat(
            [
                prefill_decompressed(
                    attn, q_nope[i : i + 1], q_pe[i : i + 1], cache, table[i, : -(-n // page)], n
                )
                for i, n in enumerate(seq_lens)
            ]
        )  # [B, H, v]
        out = mla_decode_absorbed(attn, q_nope, q_pe, cache, table, lens)
        assert _rel(out, ref) < 1e-4
        q = attn.absorb_query(q_nope, q_pe)
        one = triton_mla_decode(q, cache, table, lens, mla.kv_lora_rank, attn.scale, num_splits=1)
        for splits in (2, 4):  # split-K partials merged by their log-sum-exp
            many = triton_mla_decode(
                q, cache, table, lens, mla.kv_lora_rank, attn.scale, num_splits=splits
            )
            assert _rel(many, one) < 1e-5, splits


@kernels
def test_store_latent_writes_its_slots_and_skips_padding() -> None:
    from worker.model.triton_mla import triton_store_latent

    cache = torch.zeros(6, 4, 40, device=DEVICE)
    latent = torch.arange(3 * 40, dtype=torch.float32, device=DEVICE).view(3, 40) + 1
    triton_store_latent(latent, cache, torch.tensor([9, -1, 22], device=DEVICE))
    assert torch.equal(cache[2, 1], latent[0]) and torch.equal(cache[5, 2], latent[2])
    assert int((cache != 0).sum()) == 80  # the -1 row wrote nothing


def _mixed_batch(page: int, device: str) -> tuple[ForwardBatch, list[int]]:
    """Two decodes (contexts 9 and 20) and a prefill chunk of 6 after 5 cached tokens."""
    qs, lens = [0, 1, 2, 8], [9, 20, 11]
    tables = [[3, 7, 1], [2, 9, 4, 8, 5], [6, 10, 11]]
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    positions = [8, 19, *range(5, 11)]
    owner = [0, 1, 2, 2, 2, 2, 2, 2]
    slots = [tables[r][p // page] * page + p % page for r, p in zip(owner, positions, strict=True)]
    dev = torch.device(device)
    batch = ForwardBatch(
        input_ids=torch.zeros(8, dtype=torch.int64, device=dev),
        positions=torch.tensor(positions, device=dev),
        query_start=torch.tensor(qs, device=dev),
        seq_lens=torch.tensor(lens, device=dev),
        page_table=table.to(dev),
        slot_mapping=torch.tensor(slots, device=dev),
        logits_indices=torch.tensor([0, 1, 7], device=dev),
        query_start_list=qs,
        seq_lens_list=lens,
    )
    return batch, slots


@kernels
def test_triton_backend_equals_reference_on_a_mixed_batch() -> None:
    from worker.model.triton_mla import TritonMLABackend

    mla, heads, page = SMALL_MLA, 4, 4
    attn = _attn(mla, heads, torch.float32, seed=5)
    batch, slots = _mixed_batch(page, DEVICE)
    gen = torch.Generator().manual_seed(6)
    base = torch.randn(12, page, mla.latent_dim, generator=gen).to(DEVICE)  # earlier context
    q_nope = torch.randn(8, heads, mla.qk_nope_head_dim, generator=gen).to(DEVICE)
    q_pe = torch.randn(8, heads, mla.qk_rope_head_dim, generator=gen).to(DEVICE)
    latent = torch.randn(8, mla.latent_dim, generator=gen).to(DEVICE)
    outs, caches = [], []
    for backend in (TorchMLABackend(), TritonMLABackend()):
        cache = base.clone()
        with torch.no_grad():
            outs.append(backend.forward(attn, q_nope, q_pe, latent, cache, batch))
        caches.append(cache)
    assert torch.equal(caches[0], caches[1])  # the same rows stored in the same slots
    flat = caches[1].view(-1, mla.latent_dim)
    assert torch.equal(flat[torch.tensor(slots, device=DEVICE)], latent)
    assert _rel(outs[1], outs[0]) < 1e-4


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_absorbed_decode_in_half_precision_matches_float64(dtype: torch.dtype) -> None:
    from worker.model.triton_mla import mla_decode_absorbed

    mla, heads, page = V3_MLA, 128, 64  # a V3 layer at TP1: 128 heads, 576-wide latent
    seq_lens = [1, 63, 64, 65, 900, 4000, 0]  # 0: a padded row gives zeros
    attn = _attn(mla, heads, dtype, seed=7)
    cache, table, _ = _pages(seq_lens, mla.latent_dim, page, dtype, seed=8)
    q_nope = torch.randn(len(seq_lens), heads, mla.qk_nope_head_dim, device="cuda", dtype=dtype)
    q_pe = torch.randn(len(seq_lens), heads, mla.qk_rope_head_dim, device="cuda", dtype=dtype)
    attn64 = _attn(mla, heads, torch.float64, seed=7)
    with torch.no_grad():
        attn64.load_state_dict({k: v.double() for k, v in attn.state_dict().items()})
        ref = torch.cat(
            [
                prefill_decompressed(
                    attn64,
                    q_nope[i : i + 1].double(),
                    q_pe[i : i + 1].double(),
                    cache.double(),
                    table[i, : -(-n // page)],
                    n,
                )
                for i, n in enumerate(seq_lens[:-1])
            ]
        )
        out = mla_decode_absorbed(
            attn, q_nope, q_pe, cache, table, torch.tensor(seq_lens, device="cuda")
        )
    assert torch.isfinite(out).all()
    assert _rel(out[:-1], ref) < 2e-2
    assert out[-1].abs().max() == 0


@pytest.mark.gpu
@gpu
def test_deepseek_engine_on_cuda_equals_cpu_engine(tmp_path: Path) -> None:
    """The whole model (Triton MLA, fused norms) on CUDA in float32: the CPU engine's tokens."""
    from tests.worker.deepseek_model import build_deepseek_checkpoint
    from tests.worker.test_engine import generate
    from worker.config import (
        CacheConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        WorkerConfig,
    )
    from worker.engine import Engine

    build_deepseek_checkpoint(tmp_path, tokenizer=False)
    prompts = [
        [random.Random(i).randrange(3, 128) for _ in range(n)] for i, n in enumerate((5, 37, 70))
    ]
    tokens = []
    for device in ("cpu", "cuda"):
        engine = Engine(
            WorkerConfig(
                model=ModelConfig(path=str(tmp_path), dtype="float32"),
                cache=CacheConfig(page_size=16, num_pages=64),
                scheduler=SchedulerConfig(max_num_seqs=4, chunked_prefill_size=32),
                parallel=ParallelConfig(device=device),
            )
        )
        tokens.append(generate(engine, prompts, max_tokens=12))
        engine.scheduler.assert_drained()
    assert tokens[0] == tokens[1]
