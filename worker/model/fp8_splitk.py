"""Split-K block-scaled FP8 GEMM for decode-sized steps (1 to 64 tokens) on CUDA.

At decode sizes an FP8 linear is weight streaming: every step reads all of W [N, K] e4m3 for
a few rows of x. The tiled GEMMs (cuBLAS's blockwise `_scaled_mm`, fp8_gemm.py's Triton
GEMM) give one program per output tile, so the 4096-row projections of an 8B model make 32-96
programs for 132 SMs and read their weights at 1.1-3 TB/s (bench/fp8.py, H200). Here:

- **swap AB**: a program's tile is BN weight rows × BM tokens, `dot(W tile [BN, BK],
  x tile [BM, BK]^T)`, so the weights fill the tensor core's M side (64 or 128) and the few
  tokens its N side (16 to 64), e4m3 × e4m3 with float32 accumulation;
- **split K**: the grid is (N / BN) × SPLIT; each program walks its share of the K blocks, and
  the last of a tile's SPLIT programs to finish (a per-tile counter, `SplitCounters`) sums the
  partials in split order — deterministic — and runs the epilogue; it sets the counter back to
  0, so a CUDA graph replays with no memset;
- **activations quantized in the kernel** (bfloat16/float16 x): per token and 128-wide group,
  as `fp8_gemm.quantize_activations` does (the DeepSeek recipe), each program quantizing the x
  block it needs — no separate launch. x may also come quantized (e4m3 with its scales);
- **the step's glue in the epilogue**, as the GEMV has it (worker/model/gemv.py): `norm=` (x is
  the residual stream, RMS-normalized in the prologue), `pair=` (SwiGLU of the gate|up weight:
  the program holds its rows of both halves), `residual=` (the output added into the stream in
  place), bias.

Roundings follow the torch path (F.linear's output rounded to the model dtype, then the bias,
silu and the residual add, each rounded), so outputs agree with `fp8_linear` to bf16 rounding.
Under `TRITON_INTERPRET=1` (CPU tensors) only pre-quantized x is exact: the interpreter rounds
float32 → e4m3 wrongly (tests/worker/test_fp8_gpu.py pins it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from worker.model.fp8 import BlockFp8Config, is_fp8

MAX_TOKENS = 64  # the widest x this GEMM takes (the tensor core's N side)


@dataclass
class SplitCounters:
    """One int32 per output tile, zero between calls (the kernel's last program resets its own).
    A linear owns one; it is created on first use, outside CUDA-graph capture in the engine
    (its warm-up runs every shape eagerly first); inside a capture the zeroing is captured too."""

    counts: torch.Tensor | None = None

    def get(self, tiles: int, device: torch.device) -> torch.Tensor:
        if self.counts is None or self.counts.numel() < tiles or self.counts.device != device:
            self.counts = torch.zeros(tiles, dtype=torch.int32, device=device)
        return self.counts


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit
    def splitk_kernel(
        x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, nw_ptr, out_ptr, part_ptr, cnt_ptr,
        M, N, K, stride_xm, stride_xsm, stride_wn, stride_wsn, stride_om, eps,
        STEPS: tl.constexpr, SPLIT: tl.constexpr, SCALE_N: tl.constexpr, K_POW2: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        X_FP8: tl.constexpr, NORM: tl.constexpr, PAIR: tl.constexpr, HAS_BIAS: tl.constexpr,
        RESIDUAL: tl.constexpr, F16: tl.constexpr,
    ):
        tile = tl.program_id(0)
        split = tl.program_id(1)
        n = tile * BN + tl.arange(0, BN)  # [BN] output features
        m = tl.arange(0, BM)  # [BM] tokens
        n_mask, m_mask = n < N, m < M
        dtype = out_ptr.dtype.element_ty
        x_rows = x_ptr + m[:, None] * stride_xm  # [BM, 1]
        rstd = 0.0
        if NORM:  # one token (M = 1): its whole row's statistics first, float32 as RMSNorm
            kk = tl.arange(0, K_POW2)
            xr = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
            rstd = tl.rsqrt(tl.sum(xr * xr, 0) / K + eps)
        w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn  # [BN, 1]
        u_rows = w_ptr + (n + N).to(tl.int64)[:, None] * stride_wn  # the up half's (PAIR)
        s_row = ws_ptr + (tile * BN // SCALE_N) * stride_wsn  # this tile's row of block scales
        su_row = ws_ptr + ((tile * BN + N) // SCALE_N) * stride_wsn  # its up half's (PAIR)
        acc = tl.zeros([BN, BM], tl.float32)
        acc_up = tl.zeros([BN, BM], tl.float32)
        kb0 = split * STEPS
        kb1 = tl.minimum(kb0 + STEPS, tl.cdiv(K, BK))
        if F16:  # weights widened to float16, x scaled by each block's weight scale: one sum
            # Iteration kb loads block kb + 1's x and scales (their latency behind this step's
            # dot) and multiplies block kb; the first (kb0 - 1) only loads.
            xb = tl.zeros([BM, BK], tl.float32)
            sw = 0.0
            su = 0.0
            k_end = tl.minimum(K, kb1 * BK)  # masks from comparisons only (the interpreter's)
            for kb in range(kb0 - 1, kb1):
                kn = (kb + 1) * BK + tl.arange(0, BK)
                xn = tl.load(x_rows + kn[None, :], mask=m_mask[:, None] & (kn < k_end)[None, :],
                             other=0.0).to(tl.float32)
                if NORM:  # as layers.RMSNorm: normalized, rounded, times the weight, rounded
                    nw = tl.load(nw_ptr + kn, mask=kn < k_end, other=0.0).to(tl.float32)
                    xn = (nw[None, :] * (xn * rstd).to(dtype).to(tl.float32)).to(dtype)
                    xn = xn.to(tl.float32)
                sn = tl.load(s_row + kb + 1, mask=kb + 1 < kb1, other=0.0)
                sun = 0.0
                if PAIR:
                    sun = tl.load(su_row + kb + 1, mask=kb + 1 < kb1, other=0.0)
                k = kb * BK + tl.arange(0, BK)
                wmask = n_mask[:, None] & ((k >= kb0 * BK) & (k < K))[None, :]
                w = tl.load(w_rows + k[None, :], mask=wmask, other=0.0)  # [BN, BK] e4m3
                acc = tl.dot(w.to(tl.float16), tl.trans((xb * sw).to(tl.float16)), acc)
                if PAIR:
                    u = tl.load(u_rows + k[None, :], mask=wmask, other=0.0)
                    acc_up = tl.dot(u.to(tl.float16), tl.trans((xb * su).to(tl.float16)), acc_up)
                xb, sw, su = xn, sn, sun
        else:
            for kb in range(kb0, kb1):
                k = kb * BK + tl.arange(0, BK)
                k_mask = k < K
                wmask = n_mask[:, None] & k_mask[None, :]
                w = tl.load(w_rows + k[None, :], mask=wmask, other=0.0,
                            eviction_policy="evict_first")  # [BN, BK] e4m3
                x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                if X_FP8:  # quantized already: [BM, BK] e4m3 and its scales [BM]
                    xq = x
                    xs = tl.load(xs_ptr + m * stride_xsm + kb, mask=m_mask, other=0.0)
                else:  # quantize this block per token, as quantize_activations does
                    xf = x.to(tl.float32)
                    if NORM:  # as layers.RMSNorm: normalized, rounded, times the weight, rounded
                        nw = tl.load(nw_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
                        xf = (nw[None, :] * (xf * rstd).to(dtype).to(tl.float32))
                        xf = xf.to(dtype).to(tl.float32)
                    xs = tl.math.div_rn(tl.maximum(tl.max(tl.abs(xf), 1), 1e-10), 448.0)  # [BM]
                    xq = tl.clamp(tl.math.div_rn(xf, xs[:, None]), -448.0, 448.0).to(tl.float8e4nv)
                acc += tl.dot(w, tl.trans(xq)) * (tl.load(s_row + kb) * xs)[None, :]
                if PAIR:
                    u = tl.load(u_rows + k[None, :], mask=wmask, other=0.0,
                                eviction_policy="evict_first")
                    acc_up += tl.dot(u, tl.trans(xq)) * (tl.load(su_row + kb) * xs)[None, :]
        last = True
        if SPLIT > 1:  # park the partials; the tile's last program sums them in split order
            planes: tl.constexpr = 2 if PAIR else 1
            cell = tl.arange(0, BN)[:, None] * BM + m[None, :]  # [BN, BM]
            base = part_ptr + tile * (SPLIT * planes * BN * BM)
            tl.store(base + (split * planes) * (BN * BM) + cell, acc)
            if PAIR:
                tl.store(base + (split * planes + 1) * (BN * BM) + cell, acc_up)
            tl.debug_barrier()  # every thread's partial written before the count moves
            last = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
            if last:
                acc = tl.zeros([BN, BM], tl.float32)
                acc_up = tl.zeros([BN, BM], tl.float32)
                for s in range(SPLIT):  # L2 reads (.cg): other SMs wrote them
                    acc += tl.load(base + (s * planes) * (BN * BM) + cell, cache_modifier=".cg")
                    if PAIR:
                        acc_up += tl.load(base + (s * planes + 1) * (BN * BM) + cell,
                                          cache_modifier=".cg")
                tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next call (a graph replay)
        if last:  # [BN, BM] sums → out[m, n]: F.linear's rounding, then bias, SwiGLU, residual
            y = acc.to(dtype).to(tl.float32)
            if HAS_BIAS:
                y = y + tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
                y = y.to(dtype).to(tl.float32)
            if PAIR:  # silu(gate), rounded, times up (rounded, with its bias)
                up = acc_up.to(dtype).to(tl.float32)
                if HAS_BIAS:
                    up = up + tl.load(b_ptr + N + n, mask=n_mask, other=0.0).to(tl.float32)[
                        :, None
                    ]
                    up = up.to(dtype).to(tl.float32)
                y = ((y * tl.sigmoid(y)).to(dtype).to(tl.float32) * up).to(dtype)
                y = y.to(tl.float32)
            ptrs = out_ptr + m[None, :] * stride_om + n[:, None]  # [BN, BM]
            mask = n_mask[:, None] & m_mask[None, :]
            if RESIDUAL:  # the stream plus this output, in the model dtype, in place
                y = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) + y
            tl.store(ptrs, y.to(dtype), mask=mask)

    return SimpleNamespace(splitk=splitk_kernel)


def takes(x: torch.Tensor, quant: BlockFp8Config) -> bool:
    """Whether a step x [M, K] of a linear with this quantization runs here: CUDA, 1 to 64
    tokens of bf16/fp16 rows, scale blocks whole multiples of the 64-row tile."""
    return (
        x.device.type == "cuda"
        and 0 < x.shape[0] <= MAX_TOKENS
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.stride(1) == 1
        and quant.block_n % 64 == 0
    )


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def default_config(m: int, n: int, k: int, block_k: int) -> dict[str, int]:
    """Tile and split for M tokens against W [N, K] (N: output features, the gate half for a
    pair): BN = 64 weight rows, and enough splits that tiles × splits comes to ~2-4 programs
    per SM on an H200 (132 SMs) while each split keeps ≥ 4 K blocks. bench/fp8_splitk.py
    sweeps these."""
    tiles = -(-n // 64)
    blocks = -(-k // block_k)
    split = 1
    while tiles * split * 2 <= 528 and blocks // (split * 2) >= 4:
        split *= 2
    return dict(BN=64, SPLIT=split, num_warps=4, num_stages=4)


def fp8_splitk(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    quant: BlockFp8Config,
    counters: SplitCounters,
    bias: torch.Tensor | None = None,
    *,
    x_scale: torch.Tensor | None = None,
    pair: bool = False,
    norm: tuple[torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    **config: int,
) -> torch.Tensor:
    """x [M ≤ 64, K] (bf16/fp16; or e4m3 with `x_scale` [M, K/128]) against the block-scaled
    w [N, K] → [M, N] (N/2 with `pair`), or added into `residual` [M, N] in place (returned).
    `config` overrides default_config (BN, SPLIT, num_warps, num_stages: for sweeps)."""
    m, k = x.shape
    rows = w.shape[0]
    n = rows // 2 if pair else rows
    bk = quant.block_k
    if m > MAX_TOKENS or w.shape[1] != k or not w.is_contiguous() or x.stride(1) != 1:
        raise ValueError(
            f"fp8_splitk: x [M ≤ {MAX_TOKENS}, K] with unit column stride and a contiguous "
            f"w [N, K]; got x {tuple(x.shape)} strides {tuple(x.stride())}, w {tuple(w.shape)}"
        )
    if is_fp8(x) != (x_scale is not None) or (norm is not None and (x_scale is not None or m > 1)):
        raise ValueError(
            "fp8_splitk: an e4m3 x needs x_scale, a bf16 x none; norm= takes one bf16 token"
        )
    cfg = default_config(m, n, k, bk) | config
    bn, split = cfg.pop("BN"), cfg.pop("SPLIT")
    f16 = bool(cfg.pop("F16", x_scale is None))
    if quant.block_n % bn or (pair and n % quant.block_n):
        raise ValueError(
            f"fp8_splitk: BN={bn} must divide the scale block {quant.block_n} (and a pair's half "
            f"{n} be whole blocks)"
        )
    dtype = out_dtype or (residual.dtype if residual is not None else x.dtype)
    if residual is not None:
        if residual.shape != (m, n) or residual.stride(1) != 1:
            raise ValueError(f"residual must be [{m}, {n}] with unit column stride")
        out = residual
    else:
        out = torch.empty((m, n), dtype=dtype, device=x.device)
    if m == 0:
        return out
    bm = max(16, _next_pow2(m))
    tiles = -(-n // bn)
    blocks = -(-k // bk)
    steps = -(-blocks // split)  # K blocks per split
    planes = 2 if pair else 1
    part = torch.empty(
        (tiles * split * planes * bn * bm) if split > 1 else 1, dtype=torch.float32,
        device=x.device,
    )
    xs = x_scale if x_scale is not None else x
    _kernels().splitk[(tiles, split)](
        x, xs, w, w_scale, x if bias is None else bias, x if norm is None else norm[0], out,
        part, counters.get(tiles, x.device),
        m, n, k, x.stride(0), xs.stride(0), w.stride(0), w_scale.stride(0), out.stride(0),
        0.0 if norm is None else norm[1],
        STEPS=steps, SPLIT=split, SCALE_N=quant.block_n, K_POW2=_next_pow2(k), BM=bm, BN=bn, BK=bk,
        X_FP8=x_scale is not None, NORM=norm is not None, PAIR=pair, HAS_BIAS=bias is not None,
        RESIDUAL=residual is not None, F16=f16, **cfg,
    )
    return out
