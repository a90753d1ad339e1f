"""Block-scaled FP8 GEMM for the linears of an FP8 checkpoint (CUDA; the CPU dequantizes).

The DeepSeek-V3 recipe, as vLLM and SGLang run it: the weight is e4m3 with one float32 scale per
128×128 block (`weight_scale_inv`, worker/model/fp8.py); the activations are quantized on the
fly per token and 128-wide group of input features (1×128, dynamic: worker/model/fp8_act.py), so
each 128-deep step of the K loop is one FP8 tensor-core dot rescaled by its token's group scale
and its weight block's scale, accumulated in float32 (`block_fp8_matmul`). One-token steps do
not come here: the GEMV reads the FP8 weight and folds the block scales in
(worker/model/gemv.py), leaving the activations unquantized.

`fp8_linear` is the layers' entry point. On CUDA, steps of 1-64 tokens go to the split-K GEMM
(fp8_splitk.py: up to 32 tokens weights widened in registers and x unquantized, past that x
quantized as here and e4m3 dots) when the linear hands its tile counters; larger multi-token
steps go to `torch._scaled_mm`,
which takes this recipe on sm90 from CUDA 12.9 (scales 1×128 for A, M-major, and 128×128 for
B): on an H200 it runs the 8B projections at 8192 tokens at 1,250-1,300 TFLOP/s against this
Triton GEMM's 600-690, and at 16 and 64 tokens ahead of or level with it (bench/fp8.py, gemm
section). GPUs without the recipe, and shapes it does not take, use the Triton GEMM. Other
devices get the reference (dequantize the weight, F.linear) — the layers are built FP8 only on
CUDA, so the reference is what tests compare against.
Triton is imported lazily (the module imports without it). Under `TRITON_INTERPRET=1` on CPU
tensors the GEMM kernel runs, but activations are quantized by torch: Triton 3.9's interpreter
rounds float32 → e4m3 without the carry into the exponent (31.9 → 16) and without saturating.
"""

from __future__ import annotations

import enum
import functools
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from worker.arch.fp8_config import BlockFp8Config
from worker.model import fp8_splitk
from worker.model.fp8 import FP8, dequantize_weight
from worker.model.fp8_act import PAD_ROWS, Fp8Rows, quantize_activations
from worker.model.fp8_splitk import SplitCounters


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit
    def gemm_kernel(
        a_ptr,
        as_ptr,
        b_ptr,
        bs_ptr,
        bias_ptr,
        c_ptr,
        M,
        N,
        K,
        stride_am,
        stride_asm,
        stride_asg,
        stride_bn,
        stride_bsn,
        stride_cm,
        BLOCK_SCALE_N: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        # Grouped program order: GROUP_M row tiles share each column tile's weights in L2.
        pid = tl.program_id(0)
        tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        group = pid // (GROUP_M * tiles_n)
        first_m = group * GROUP_M
        size_m = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % (GROUP_M * tiles_n)) % size_m
        pid_n = (pid % (GROUP_M * tiles_n)) // size_m
        m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] tokens
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output features
        kk = tl.arange(0, BLOCK_K)
        m_mask, n_mask = m < M, n < N
        a_rows = a_ptr + m.to(tl.int64)[:, None] * stride_am  # [BM, 1]
        b_cols = (
            b_ptr + n.to(tl.int64)[None, :] * stride_bn
        )  # [1, BN]: W is [N, K], read as [K, BN]
        bs_rows = bs_ptr + (n // BLOCK_SCALE_N) * stride_bsn  # [BN]: each column's weight scale row
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):  # BLOCK_K = the scale block: one scale per step
            k = kb * BLOCK_K + kk
            k_mask = k < K
            a = tl.load(
                a_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0
            )  # [BM, BK]
            b = tl.load(
                b_cols + k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0
            )  # [BK, BN]
            a_s = tl.load(as_ptr + m * stride_asm + kb * stride_asg, mask=m_mask, other=0.0)  # [BM]
            b_s = tl.load(bs_rows + kb, mask=n_mask, other=0.0)  # [BN]
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        c = c_ptr + m.to(tl.int64)[:, None] * stride_cm + n[None, :]
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])

    return SimpleNamespace(gemm=gemm_kernel)


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


def _config(m: int) -> dict[str, int]:
    """Tile shape by token count: decode batches take short row tiles (the weight read is the
    cost), prefill square 128-wide tiles (tensor-core bound). Not swept yet: bench/fp8.py."""
    if m <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, GROUP_M=1, num_warps=4, num_stages=4)
    if m <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, GROUP_M=1, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=3)


def block_fp8_matmul(
    xq: torch.Tensor,
    xs: torch.Tensor,
    w: torch.Tensor,
    ws: torch.Tensor,
    quant: BlockFp8Config,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    **config: int,
) -> torch.Tensor:
    """xq [M, K] e4m3 with scales xs [M, K/bk], w [N, K] e4m3 with block scales ws
    [N/bn, K/bk] → (xq·xs) (w·ws)^T (+ bias) [M, N] in out_dtype, float32 accumulation."""
    m, k = xq.shape
    n = w.shape[0]
    if w.shape[1] != k or not w.is_contiguous() or xq.stride(1) != 1:
        raise ValueError(
            f"block_fp8_matmul: w must be a contiguous [N, K={k}], got {tuple(w.shape)} "
            f"strides {tuple(w.stride())}"
        )
    if ws.shape != (-(-n // quant.block_n), -(-k // quant.block_k)) or xs.shape != (
        m,
        -(-k // quant.block_k),
    ):
        raise ValueError(
            f"block_fp8_matmul: scales {tuple(xs.shape)} / {tuple(ws.shape)} do not match "
            f"M={m}, N={n}, K={k} with blocks {quant.block_n}x{quant.block_k}"
        )
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    cfg = _config(m) | config
    grid = (-(-m // cfg["BLOCK_M"]) * -(-n // cfg["BLOCK_N"]),)
    _kernels().gemm[grid](
        xq,
        xs,
        w,
        ws,
        out if bias is None else bias,
        out,
        m,
        n,
        k,
        xq.stride(0),
        xs.stride(0),
        xs.stride(1),
        w.stride(0),
        ws.stride(0),
        out.stride(0),
        BLOCK_SCALE_N=quant.block_n,
        HAS_BIAS=bias is not None,
        BLOCK_K=quant.block_k,
        **cfg,
    )
    return out


def cublas_blockwise(device: torch.device) -> bool:
    """Whether torch._scaled_mm runs the 1x128 / 128x128 recipe on `device` (cuBLAS on sm90
    from CUDA 12.9); tried once per GPU on one block. The loader asks first, outside any CUDA
    graph capture (`cuda` and `cuda:0` are one GPU: one probe)."""
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    return _probe_cublas(device)


@functools.cache
def _probe_cublas(device: torch.device) -> bool:
    a = torch.zeros(128, 128, dtype=FP8, device=device)
    one = torch.ones(1, 128, device=device).t()  # [128, 1] M-major: A's scales
    try:
        torch._scaled_mm(a, a.t(), one, torch.ones(1, 1, device=device), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError, ValueError):
        return False
    return True


class Route(enum.Enum):
    """Where `fp8_linear` sends a step (`route`)."""

    REFERENCE = "reference"  # not CUDA: the weight dequantized, F.linear
    SPLITK = "splitk"  # 1-32 tokens: fp8_splitk.py, x unquantized
    SPLITK_QUANTIZED = "splitk_quantized"  # 33-64 tokens: x quantized 1×128, fp8_splitk.py
    CUBLAS = "cublas"  # x quantized 1×128 (fp8_act.py), cuBLAS's blockwise _scaled_mm
    TRITON = "triton"  # x quantized 1×128, the block-scaled Triton GEMM above


def route(
    m: int, k: int, n: int, dtype: torch.dtype, device: torch.device, quant: BlockFp8Config,
    splitk: bool,
) -> Route:
    """The path of a step x [m, k] (dtype, device) through W [n, k]; `splitk`: the linear hands
    its tile counters. The split-K GEMM takes 1-64 tokens (bench/fp8_splitk.py); cuBLAS every
    other multi-token step it can (bench/fp8.py's gemm rows, H200: ahead of or level with the
    Triton GEMM's best tile at 16 and 64 tokens, 1.9x at 8192); Triton where cuBLAS lacks the
    recipe or the shape (K a multiple of 512, N of 128)."""
    if device.type != "cuda" and not _interpreting():
        return Route.REFERENCE
    if splitk and device.type == "cuda" and fp8_splitk.fits(m, dtype, quant):
        if fp8_splitk.mode(m) is fp8_splitk.Mode.WIDENED:
            return Route.SPLITK
        return Route.SPLITK_QUANTIZED
    if (
        device.type == "cuda"
        and dtype == torch.bfloat16
        and (quant.block_n, quant.block_k) == (128, 128)
        and n % 128 == 0
        and k % 512 == 0  # B's scales [K/128, N/128]: K/128 a multiple of 4 (see fp8_linear)
        and cublas_blockwise(device)
    ):
        return Route.CUBLAS
    return Route.TRITON


_ROWS_ROUTES = (Route.CUBLAS, Route.SPLITK_QUANTIZED)  # the routes that take Fp8Rows


def input_rows(
    m: int, k: int, n: int, dtype: torch.dtype, device: torch.device, quant: BlockFp8Config,
    splitk: bool,
) -> Fp8Rows | None:
    """Buffers for a linear's input x [m, k] when `fp8_linear` would quantize it 1×128 for cuBLAS
    or the split-K GEMM, for the kernel that produces x to fill (worker/model/fused.py
    `into=`); None on any other route (those read x as it is, or quantize it their own way)."""
    if m == 0 or route(m, k, n, dtype, device, quant, splitk) not in _ROWS_ROUTES:
        return None
    return Fp8Rows.empty(m, k, dtype, device)


def fp8_linear(
    x: torch.Tensor | Fp8Rows,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    quant: BlockFp8Config,
    counters: SplitCounters | None = None,
) -> torch.Tensor:
    """x [..., K] @ dequant(w [N, K], w_scale)^T (+ bias) → [..., N] in x's dtype. `counters`
    (the linear's own) lets decode-sized steps take the split-K GEMM (fp8_splitk.py). x may
    come quantized already (`Fp8Rows`, from `input_rows`): it goes where `input_rows` meant."""
    if isinstance(x, Fp8Rows):
        path = route(x.rows, w.shape[1], w.shape[0], x.dtype, x.q.device, quant,
                     counters is not None)
        return _quantized(x, path, w, w_scale, bias, quant, counters)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    path = route(x2.shape[0], k, w.shape[0], x.dtype, x.device, quant, counters is not None)
    if path is Route.REFERENCE:
        return F.linear(
            x2, dequantize_weight(w, w_scale, (quant.block_n, quant.block_k), x.dtype), bias
        ).view(*lead, -1)
    if path is Route.SPLITK and counters is not None:
        x2 = x2 if x2.stride(1) == 1 else x2.contiguous()
        return fp8_splitk.fp8_splitk(x2, w, w_scale, quant, counters, bias).view(*lead, -1)
    if path in _ROWS_ROUTES:
        xq, xs = quantize_activations(x2, quant.block_k, pad_rows=PAD_ROWS, m_major=True)
        rows = Fp8Rows(xq, xs, x2.shape[0], x.dtype)
        return _quantized(rows, path, w, w_scale, bias, quant, counters).view(*lead, -1)
    xq, xs = quantize_activations(x2, quant.block_k)
    return block_fp8_matmul(xq, xs, w, w_scale, quant, bias, x.dtype).view(*lead, -1)


def _quantized(
    x: Fp8Rows, path: Route, w: torch.Tensor, w_scale: torch.Tensor,
    bias: torch.Tensor | None, quant: BlockFp8Config, counters: SplitCounters | None,
) -> torch.Tensor:
    """x quantized 1×128 on its route (one of `_ROWS_ROUTES`): the split-K GEMM (33-64 tokens,
    the linear's counters) or cuBLAS."""
    if path is Route.SPLITK_QUANTIZED and counters is not None:
        return fp8_splitk.fp8_splitk(x, w, w_scale, quant, counters, bias)
    return _cublas(x, w, w_scale, bias)


def _cublas(
    x: Fp8Rows, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    # cuBLAS reads each scale tensor's leading dimension in 16-byte units: A's (M) is padded to
    # a multiple of 4 rows (Fp8Rows), B's (K/128) must be one already (`route`). With K/128 = 2
    # or 3 it does not refuse: it misreads the scales (an H200, torch 2.13).
    out = torch._scaled_mm(x.q, w.t(), x.scales, w_scale.t(), out_dtype=x.dtype)[: x.rows]
    return out if bias is None else out.add_(bias)
