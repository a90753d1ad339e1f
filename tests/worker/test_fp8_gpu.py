"""FP8 kernels against their dequantized references: the KV store, the paged decode kernel and
the fused q/k norm + RoPE store over e4m3 pages with per-head scales
(worker/model/triton_decode.py, fused_rope.py); the block-scaled GEMM and the FP8 GEMV
(worker/model/fp8_gemm.py, gemv.py); and a GPU engine serving an FP8 checkpoint with FP8 KV.

Kernel tests run on CUDA; with `TRITON_INTERPRET=1` and triton installed the kernels that only
read FP8 (paged decode, GEMM, GEMV) also run on CPU tensors (float16 there: the interpreter
truncates float32 → bfloat16, see test_gemv_gpu.py). The ones that write e4m3 (the stores, the
activation quantizer) run on CUDA only: Triton 3.9's interpreter rounds float32 → e4m3 without
the carry into the exponent (31.9 → 16, 1.99 → 1) and without saturating (500 → 256), so its
stores differ from any real conversion; `_INTERPRETER_E4M3` pins that, so a fixed interpreter
shows up here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.worker.test_fused_gpu import DEVICE, HAS_GPU, INTERPRET, _rel, gpu, kernels
from worker.arch.fp8_config import GPU_BLOCK_K, BlockFp8Config
from worker.model import fp8
from worker.model.attention import store_kv

DTYPES = [torch.float16] if INTERPRET else [torch.bfloat16, torch.float16]
stores_e4m3 = pytest.mark.skipif(
    INTERPRET, reason="the interpreter rounds float32 → e4m3 wrongly (module doc)"
)
SCALES = (
    torch.tensor([0.02, 0.05, 0.01, 0.03]),
    torch.tensor([0.04, 0.01, 0.02, 0.05]),
)  # per kv head


def _dev(t: torch.Tensor) -> torch.Tensor:
    return t.to(DEVICE)


def _scales() -> tuple[torch.Tensor, torch.Tensor]:
    return _dev(SCALES[0]), _dev(SCALES[1])


def _token_major(cache: torch.Tensor) -> torch.Tensor:
    """The same [P, Hkv, S, D] values laid out as a KVCache keeps FP8 V: [P, Hkv, D, S]."""
    return cache.transpose(2, 3).contiguous().transpose(2, 3)


@pytest.mark.gpu
@kernels
@stores_e4m3
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("token_major", [False, True])
def test_store_kernel_quantizes_like_the_reference(dtype: torch.dtype, token_major: bool) -> None:
    from worker.model.triton_decode import triton_store_kv

    g = torch.Generator().manual_seed(0)
    t, hkv, d, page = 9, 4, 64, 4
    k, v = (_dev(torch.randn(t, hkv, d, generator=g).to(dtype)) for _ in range(2))
    v[3, 1, 5] = float("nan")  # never stored as NaN in a V page: 0 (worker/model/triton_pages.py)
    slots = _dev(torch.tensor([5, 17, -1, 2, 30, 31, 8, 9, 12]))
    caches = [torch.zeros(10, hkv, page, d, dtype=fp8.FP8, device=DEVICE) for _ in range(2)]
    caches += [torch.zeros(10, hkv, page, d, dtype=fp8.FP8) for _ in range(2)]  # the reference's
    if token_major:
        caches[1], caches[3] = _token_major(caches[1]), _token_major(caches[3])
    triton_store_kv(k, v, caches[0], caches[1], slots, _scales())
    store_kv(k.cpu(), v.cpu(), caches[2], caches[3], slots.cpu(), SCALES)  # type: ignore[arg-type]
    assert caches[1][0, 1, 2, 5].item() == 0 and caches[3][0, 1, 2, 5].item() == 0  # slot 2
    for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
        same = (got.cpu().float() == want.cpu().float()).float().mean()
        assert same > 0.99  # the same division and rounding; a last-place tie may round apart
        assert _rel(got.cpu().float(), want.cpu().float()) < 1e-2


@pytest.mark.gpu
@kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("token_major", [False, True])
def test_paged_decode_reads_fp8_pages(dtype: torch.dtype, splits: int, token_major: bool) -> None:
    from worker.model.triton_decode import triton_paged_decode

    g = torch.Generator().manual_seed(1)
    seq_lens, hq, hkv, d, page = [1, 17, 130, 0], 8, 4, 64, 16
    num_pages = 16
    k_deq = torch.randn(num_pages, hkv, page, d, generator=g)
    v_deq = torch.randn(num_pages, hkv, page, d, generator=g)
    k_cache = (
        fp8.quantize_kv(k_deq.transpose(1, 2).reshape(-1, hkv, d), SCALES[0] * 40)
        .reshape(num_pages, page, hkv, d)
        .transpose(1, 2)
        .contiguous()
    )  # [P, Hkv, S, D] e4m3
    v_cache = (
        fp8.quantize_kv(v_deq.transpose(1, 2).reshape(-1, hkv, d), SCALES[1] * 40)
        .reshape(num_pages, page, hkv, d)
        .transpose(1, 2)
        .contiguous()
    )
    ks, vs = SCALES[0] * 40, SCALES[1] * 40
    table = torch.tensor(
        [
            [3, 0, 0, 0, 0, 0, 0, 0, 0],
            [5, 1, 0, 0, 0, 0, 0, 0, 0],
            [2, 4, 6, 7, 8, 9, 10, 11, 12],
            [0] * 9,
        ]
    )
    q = torch.randn(len(seq_lens), hq, d, generator=g).to(dtype)
    out = triton_paged_decode(
        _dev(q),
        _dev(k_cache),
        _dev(_token_major(v_cache) if token_major else v_cache),
        _dev(table),
        _dev(torch.tensor(seq_lens)),
        d**-0.5,
        None,
        num_splits=splits,
        kv_scales=(_dev(ks), _dev(vs)),
    ).cpu()
    kf = k_cache.double() * ks.double()[None, :, None, None]  # the dequantized pages, float64
    vf = v_cache.double() * vs.double()[None, :, None, None]
    for i, n in enumerate(seq_lens[:-1]):
        pages = table[i, : -(-n // page)]
        kk = kf[pages].transpose(0, 1).reshape(hkv, -1, d)[:, :n].repeat_interleave(hq // hkv, 0)
        vv = vf[pages].transpose(0, 1).reshape(hkv, -1, d)[:, :n].repeat_interleave(hq // hkv, 0)
        p = (torch.einsum("hd,hld->hl", q[i].double(), kk) * d**-0.5).softmax(-1)
        assert _rel(out[i], torch.einsum("hl,hld->hd", p, vv)) < 1e-2, (i, n)
    assert out[-1].abs().max() == 0  # a seq_len-0 row (graph padding)


@pytest.mark.gpu
@kernels
@stores_e4m3
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("token_major", [False, True])
def test_fused_qk_norm_rope_stores_fp8(dtype: torch.dtype, token_major: bool) -> None:
    """The fused store divides by each head's scale and saturates as store_kv does, into V
    pages of either layout."""
    from tests.worker.test_fused_gpu import ROPES, _norm, _strided
    from worker.model import fused_rope
    from worker.model.rope import RotaryEmbedding

    g = torch.Generator().manual_seed(3)
    t, hq, hkv, d, page = 6, 8, 4, 64, 4
    qkv = _strided(t, (hq + 2 * hkv) * d, dtype, g, scale=2.0)
    cos, sin = RotaryEmbedding(ROPES["default"], d, DEVICE).cos_sin(_dev(torch.arange(t) * 37))
    qn, kn = _norm(d, dtype, g), _norm(d, dtype, g)
    slots = _dev(torch.tensor([0, 5, 9, -1, 14, 3]))
    kc, vc = (torch.zeros(4, hkv, page, d, dtype=fp8.FP8, device=DEVICE) for _ in range(2))
    ref_k, ref_v = (torch.zeros(4, hkv, page, d, dtype=fp8.FP8) for _ in range(2))
    if token_major:
        vc, ref_v = _token_major(vc), _token_major(ref_v)
    unfused = qkv.clone()
    fused_rope.qk_norm_rope(
        qkv,
        hq,
        hkv,
        cos,
        sin,
        qn.weight,
        kn.weight,
        1e-6,
        kv_cache=(kc, vc, slots),
        kv_scales=_scales(),
    )
    fused_rope.qk_norm_rope(
        unfused, hq, hkv, cos, sin, qn.weight, kn.weight, 1e-6
    )  # the same rotation, no store
    k = unfused[:, hq * d : (hq + hkv) * d].reshape(t, hkv, d).cpu()
    v = unfused[:, (hq + hkv) * d :].reshape(t, hkv, d).cpu()
    keep = slots.cpu() >= 0
    store_kv(k[keep], v[keep], ref_k, ref_v, slots.cpu()[keep], SCALES)
    assert torch.equal(qkv, unfused)  # q/k rotated in place exactly as without the store
    for got, want in ((kc, ref_k), (vc, ref_v)):
        assert (got.cpu().float() == want.float()).float().mean() > 0.99


BLOCK = BlockFp8Config()


def _fp8_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * k**-0.5
    q, s = fp8.quantize_blockwise(w)
    return _dev(q), _dev(s), fp8.dequantize_weight(q, s, (128, 128))  # FP8, scales, the reference


@pytest.mark.gpu
@kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 256, 384), (5, 200, 300), (64, 384, 256), (130, 256, 1024)])
def test_block_fp8_gemm_matches_its_dequantized_reference(
    dtype: torch.dtype, m: int, n: int, k: int
) -> None:
    from worker.model.fp8_act import quantize_activations
    from worker.model.fp8_gemm import block_fp8_matmul, fp8_linear

    w, ws, w_ref = _fp8_weight(n, k, seed=m + n)
    x = _dev(torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(dtype))
    bias = _dev(torch.randn(n).to(dtype))
    xq, xs = (_dev(t) for t in quantize_activations(x.cpu()))  # torch's quantization, the reference
    assert xq.dtype == fp8.FP8 and xs.shape == (m, -(-k // 128))
    if not INTERPRET:  # the Triton quantizer (CUDA) gives the same bytes and scales
        gq, gs = quantize_activations(x)
        assert torch.allclose(gs, xs) and (gq.float() == xq.float()).float().mean() > 0.99
    x_deq = (
        xq.cpu().float() * xs.cpu().repeat_interleave(128, 1)[:, :k]
    )  # what the kernel multiplies
    assert _rel(x_deq, x.cpu().float()) < 0.04
    out = block_fp8_matmul(xq, xs, w, ws, BLOCK, bias, dtype)
    exact = F.linear(x_deq, w_ref, bias.cpu().float())  # the same operands, float32
    assert out.dtype == dtype and _rel(out.cpu(), exact) < 1e-2
    # The layer's entry point: within FP8's rounding of x and w of the unquantized product.
    assert (
        _rel(
            fp8_linear(x, w, ws, bias, BLOCK).cpu(),
            F.linear(x.cpu().float(), w_ref, bias.cpu().float()),
        )
        < 0.06
    )


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "m,n,k", [(2, 256, 512), (130, 256, 1024), (301, 384, 512), (300, 200, 512), (64, 384, 256)]
)  # N = 200 is not whole blocks, K = 256 has 2 scale columns: both the Triton GEMM's
def test_multi_token_steps_take_cublas_with_the_same_operands(m: int, n: int, k: int) -> None:
    """fp8_linear over ≥ 2 tokens: torch._scaled_mm (where the GPU has the blockwise recipe;
    rows padded to a multiple of 4) on the same quantized operands as the Triton GEMM, so both
    agree."""
    from worker.model import fp8_gemm
    from worker.model.fp8_act import quantize_activations

    if not fp8_gemm.cublas_blockwise(torch.device(DEVICE)):
        pytest.skip("this GPU / CUDA has no blockwise scaled_mm")
    w, ws, _ = _fp8_weight(n, k, seed=m)
    x = _dev(torch.randn(m, k, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16))
    bias = _dev(torch.randn(n).to(torch.bfloat16))
    cublas = fp8_gemm.route(m, k, n, x.dtype, x.device, BLOCK, False) is fp8_gemm.Route.CUBLAS
    assert cublas == (n % 128 == 0 and k % 512 == 0)
    xq, xs = quantize_activations(x)
    triton = fp8_gemm.block_fp8_matmul(xq, xs, w, ws, BLOCK, bias, torch.bfloat16)
    out = fp8_gemm.fp8_linear(x, w, ws, bias, BLOCK)
    assert out.dtype == torch.bfloat16 and _rel(out.float(), triton.float()) < 1e-2


@pytest.mark.gpu
@kernels
@pytest.mark.parametrize("n,k", [(256, 384), (130, 4096), (64, 9000)])  # 9000: the looping kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_gemv_folds_the_block_scales_in(dtype: torch.dtype, n: int, k: int) -> None:
    from tests.worker.test_fused_gpu import _norm
    from worker.model import gemv

    g = torch.Generator().manual_seed(n + k)
    w, ws, _ = _fp8_weight(n, k, seed=k)
    # Row 0 all e4m3 subnormals (bytes 0x01-0x07 and their negatives): the kernel keeps them.
    sub = torch.arange(k) % 7 + 1
    w.view(torch.uint8)[0] = _dev((sub | (torch.arange(k) % 2 * 0x80)).to(torch.uint8))
    w_ref = fp8.dequantize_weight(w.cpu(), ws.cpu(), (128, 128))
    x = _dev(torch.randn(1, k, generator=g).to(dtype))
    ref = F.linear(x.cpu().float(), w_ref)
    out = gemv.gemv(
        x,
        w,
        w_scale=ws,
        block=(128, 128),
        out=torch.empty(1, n, dtype=torch.float32, device=DEVICE),
    )
    assert _rel(out.cpu(), ref) < 1e-2 and _rel(out[:, :1].cpu(), ref[:, :1]) < 1e-2
    norm = _norm(k, dtype, g)  # the norm folded in (K whole or looped), and the gate|up pair
    with torch.no_grad():
        xn = norm(x).cpu().float()
    for cfg in ({}, {"BLOCK_K": 128, "num_stages": 3}):
        out = gemv.gemv(x, w, norm=(norm.weight, norm.eps), w_scale=ws, block=(128, 128), **cfg)
        assert _rel(out.cpu(), F.linear(xn, w_ref)) < 2e-2
        pair = gemv.gemv(x, w, pair=True, w_scale=ws, block=(128, 128), **cfg)
        gate, up = ref.chunk(2, dim=-1)
        assert _rel(pair.cpu(), F.silu(gate) * up) < 2e-2
    stream = _dev(torch.randn(1, n, generator=g).to(dtype))
    before = stream.cpu().float()
    gemv.gemv(x, w, residual=stream, w_scale=ws, block=(128, 128))
    assert _rel(stream.cpu().float(), before + ref) < 1e-2
    with pytest.raises(ValueError, match="w_scale must be float32"):
        gemv.gemv(x, w, w_scale=ws[:, :1], block=(128, 128))


@pytest.mark.gpu
@gpu
def test_gpu_engine_serves_an_fp8_checkpoint_with_fp8_kv(tmp_path: Path) -> None:
    """FP8 linears (Triton GEMM, FP8 GEMV at batch 1) + FP8 KV pages under decode graphs on the
    GPU give mostly the CPU engine's greedy tokens for the same FP8 checkpoint (the CPU runs the
    dequantized weights and the float32 reference attention)."""
    import random

    from models.make_fp8 import convert
    from tests.worker.conftest import build_tiny_checkpoint
    from tests.worker.test_engine import generate
    from worker.config import (
        CacheConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        WorkerConfig,
    )
    from worker.engine import Engine

    src, dst = tmp_path / "src", tmp_path / "fp8"
    build_tiny_checkpoint(
        src,
        "qwen3",
        hidden_size=256,
        intermediate_size=384,
        head_dim=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
    )
    convert(src, dst)
    rng = random.Random(0)
    prompts = [[rng.randrange(97) for _ in range(rng.randrange(3, 90))] for _ in range(6)]

    def engine(device: str) -> Engine:
        return Engine(
            WorkerConfig(
                model=ModelConfig(path=str(dst), dtype="bfloat16"),
                cache=CacheConfig(page_size=16, num_pages=256, kv_cache_dtype="fp8_e4m3"),
                scheduler=SchedulerConfig(max_num_seqs=8, chunked_prefill_size=64),
                parallel=ParallelConfig(device=device),
            )
        )

    gpu_engine = engine("cuda")
    layer = gpu_engine.model.model.layers[0]  # type: ignore[union-attr, index]
    assert layer.mlp.down_proj.weight.dtype == fp8.FP8 and gpu_engine.kv.shape.dtype == fp8.FP8
    gpu_engine.runner.enable_cuda_graphs(8, 256)
    gpu_tokens = generate(gpu_engine, prompts, max_tokens=16) + generate(
        gpu_engine, prompts[:1], max_tokens=16
    )
    cpu_engine = engine("cpu")
    cpu_tokens = generate(cpu_engine, prompts, max_tokens=16) + generate(
        cpu_engine, prompts[:1], max_tokens=16
    )
    first = sum(a[0] == b[0] for a, b in zip(gpu_tokens, cpu_tokens, strict=True))
    assert first >= 5, (
        f"{first}/7 first tokens equal"
    )  # bf16 + FP8 activations vs the CPU's float32 path


_INTERPRETER_E4M3 = (
    [31.9, 1.99, 500.0],
    [16.0, 1.0, 256.0],
)  # what triton 3.9's interpreter stores


@pytest.mark.skipif(
    not INTERPRET, reason="pins the interpreter's e4m3 rounding (TRITON_INTERPRET=1)"
)
def test_the_interpreter_still_rounds_e4m3_wrongly() -> None:
    """Why the store tests skip under the interpreter; fails once Triton fixes it (then drop
    `stores_e4m3`)."""
    import triton
    import triton.language as tl

    @triton.jit
    def cast(x_ptr, z_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(z_ptr + i, tl.load(x_ptr + i).to(z_ptr.dtype.element_ty))

    x = torch.tensor([*_INTERPRETER_E4M3[0], 0.0])  # a power of two long: tl.arange
    got = torch.empty(4, dtype=fp8.FP8)
    cast[(1,)](x, got, N=4)
    assert got[:3].float().tolist() == _INTERPRETER_E4M3[1]
    assert x[:3].to(fp8.FP8).float().tolist() == [32.0, 2.0, 448.0]  # torch: rounded, saturated


def test_cpu_has_no_fp8_kernels() -> None:
    """The CPU keeps the reference: an FP8 checkpoint's linears are built unquantized there."""
    from worker.model.fp8_gemm import fp8_linear

    assert HAS_GPU or not torch.cuda.is_available()
    w, ws, w_ref = _fp8_weight(256, 256, seed=0)
    if DEVICE == "cpu" and not INTERPRET:
        x = torch.randn(3, 256)
        assert torch.allclose(fp8_linear(x, w, ws, None, BLOCK), F.linear(x, w_ref))


@pytest.mark.gpu
@kernels
@pytest.mark.parametrize("block_k", GPU_BLOCK_K)
@pytest.mark.parametrize("m", [3, 130])
def test_fp8_linear_runs_every_block_k_the_loader_keeps_in_fp8(block_k: int, m: int) -> None:
    """The blocks `BlockFp8Config.gpu_kernels_take` admits run the Triton GEMM (and its
    activation quantizer, grouped by block_k); a 96-wide block fails to build (tl.arange), which
    is why the loader dequantizes such a checkpoint instead (worker/model/loader.py)."""
    from worker.model.fp8_gemm import fp8_linear

    quant = BlockFp8Config(64, block_k)
    w = torch.randn(192, 320, generator=torch.Generator().manual_seed(block_k)) * 320**-0.5
    q, s = fp8.quantize_blockwise(w, 64, block_k)
    x = torch.randn(m, 320, generator=torch.Generator().manual_seed(m)).to(DTYPES[0])
    out = fp8_linear(_dev(x), _dev(q), _dev(s), None, quant)
    ref = F.linear(x.float(), fp8.dequantize_weight(q, s, (64, block_k)))
    assert _rel(out.cpu(), ref) < 0.05
