"""Triton GEMV for decode at small batch: y = x W^T for a few rows of x (CUDA).

At batch 1 a decode step is weight streaming: every projection reads its whole matrix for one
row of output. cuBLAS's M = 1 kernels read the 4096-wide projections (qkv, o, down) at
3.1–3.5 TB/s on an H200, below the 4.27 TB/s copy rate. This kernel gives each program a
few whole output rows, walks K in wide contiguous blocks (each weight row is contiguous, so
every load is one coalesced stream), keeps a 2-D float32 partial sum and reduces it once at
the end, so the only traffic is the weights, read once, evicted first.

`gemv(x, w)` is F.linear(x, w) for x [M, K] with M ≤ MAX_ROWS. `gemv(x, w, pair=True)` is
silu(x W_gate^T) * (x W_up^T) for the fused gate|up weight [2I, K] (SwiGLU's activation as
the epilogue: each program owns the matching gate and up rows), rounded where the torch
reference rounds. Sums run in float32 in a different order than cuBLAS's, so results agree
with F.linear to bf16 rounding, not bit for bit.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from worker.model.fused import next_pow2

MAX_ROWS = 4  # the most rows of x one call takes; larger batches are matmuls (cuBLAS)


def _config(m: int, k: int, pair: bool) -> dict[str, int]:
    """Block shape and launch settings (swept on an H200, bench/gemv.py --sweep): two output
    rows per program, 2048-wide K blocks, 8 warps; narrower K blocks when the float32 partial
    sums (rows × 2 × block_k, twice for gate|up) would not fit in 64 registers per thread."""
    block_m, block_k = next_pow2(m), min(2048, next_pow2(k))
    while block_m * 2 * block_k * (2 if pair else 1) > 64 * 32 * 8 and block_k > 256:
        block_k //= 2
    return dict(BLOCK_M=block_m, BLOCK_N=2, BLOCK_K=block_k, num_warps=8, num_stages=2)


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit
    def gemv_kernel(
        x_ptr, w_ptr, b_ptr, nw_ptr, r_ptr, out_ptr, M, N, stride_x, stride_w, stride_r, stride_out,
        pair_offset, eps,
        K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PAIR: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
    ):
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output features
        k = tl.arange(0, BLOCK_K)  # [BK]
        m = tl.arange(0, BLOCK_M)  # [BM] rows of x
        n_mask = n < N
        m_mask = m < M
        dtype = x_ptr.dtype.element_ty
        x_rows = x_ptr + m[:, None] * stride_x  # [BM, 1]
        w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_w  # [BN, 1]
        if NORM:  # x is the residual stream: RMSNorm each row on the fly (float32 statistics)
            sq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
            for i in range(0, tl.cdiv(K, BLOCK_K)):
                kk = i * BLOCK_K + k
                xs = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & (kk < K)[None, :], other=0.0)
                sq += xs.to(tl.float32) * xs.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(sq, 1) / K + eps)[:, None]  # [BM, 1]
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)  # reduced once, after the loop
        acc_up = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
        for i in range(0, tl.cdiv(K, BLOCK_K)):
            kk = i * BLOCK_K + k
            k_mask = kk < K
            mask = n_mask[:, None] & k_mask[None, :]
            w = tl.load(w_rows + kk[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
            x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            if NORM:  # as layers.RMSNorm: normalized, rounded, times the weight, rounded
                nw = tl.load(nw_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)[None, :]
                x = (nw * (x * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            x3 = x[:, None, :]  # [BM, 1, BK]
            acc += w.to(tl.float32)[None, :, :] * x3
            if PAIR:
                u = tl.load(w_rows + pair_offset + kk[None, :], mask=mask, other=0.0,
                            eviction_policy="evict_first")
                acc_up += u.to(tl.float32)[None, :, :] * x3
        y = tl.sum(acc, 2)  # [BM, BN]
        if HAS_BIAS:
            y = y.to(dtype).to(tl.float32) + tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        y = y.to(dtype).to(tl.float32)  # rounded as F.linear's output is
        if PAIR:  # SwiGLU: silu(gate), rounded, times up
            up = tl.sum(acc_up, 2)
            if HAS_BIAS:
                up = up.to(dtype).to(tl.float32) + tl.load(b_ptr + N + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            up = up.to(dtype).to(tl.float32)
            y = ((y * tl.sigmoid(y)).to(dtype).to(tl.float32) * up).to(dtype).to(tl.float32)
        out_mask = m_mask[:, None] & n_mask[None, :]
        if RESIDUAL:  # the residual stream plus this output, in the model dtype
            r = tl.load(r_ptr + m[:, None] * stride_r + n[None, :], mask=out_mask, other=0.0).to(tl.float32)
            y = (r + y).to(dtype).to(tl.float32)
        tl.store(out_ptr + m[:, None] * stride_out + n[None, :], y, mask=out_mask)

    return SimpleNamespace(gemv=gemv_kernel)


def gemv(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *, pair: bool = False,
    norm: tuple[torch.Tensor, float] | None = None, residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None, **config: int,
) -> torch.Tensor:
    """y = x w^T (+ bias) for x [M, K] (M ≤ MAX_ROWS, unit column stride), w [N, K] contiguous.

    - pair: w is gate|up [2I, K] (bias too); y = silu(gate) * up [M, I].
    - norm (weight [K], eps): x is first RMSNorm-ed as layers.RMSNorm does.
    - residual [M, N]: y = residual + y, written into residual (the stream updated in place).
    - out: where y goes, any float dtype (logits in float32): y is rounded to x's dtype first.
    `config` overrides the block shape (BLOCK_N, BLOCK_K, num_warps, num_stages; for sweeps)."""
    m, k = x.shape
    rows, wk = w.shape
    if m > MAX_ROWS or wk != k or x.stride(1) != 1 or not w.is_contiguous() or x.dtype != w.dtype:
        raise ValueError(f"gemv takes x [M ≤ {MAX_ROWS}, K] with unit column stride and a contiguous "
                         f"w [N, K] of x's dtype; got x {tuple(x.shape)} strides {tuple(x.stride())} "
                         f"{x.dtype}, w {tuple(w.shape)} {w.dtype}")
    if pair and rows % 2:
        raise ValueError(f"gemv(pair=True) needs the fused gate|up weight (an even row count), got {rows}")
    n = rows // 2 if pair else rows
    if bias is not None and bias.shape != (rows,):
        raise ValueError(f"bias must be [{rows}], got {tuple(bias.shape)}")
    if norm is not None and norm[0].shape != (k,):
        raise ValueError(f"norm weight must be [{k}], got {tuple(norm[0].shape)}")
    if residual is not None:
        if residual.shape != (m, n) or residual.dtype != x.dtype or residual.stride(1) != 1:
            raise ValueError(f"residual must be [{m}, {n}] {x.dtype} with unit column stride, got "
                             f"{tuple(residual.shape)} {residual.dtype}")
        out = residual
    elif out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.stride(1) != 1:
        raise ValueError(f"out must be [{m}, {n}] with unit column stride, got {tuple(out.shape)}")
    if m:
        cfg = _config(m, k, pair) | config
        _kernels().gemv[(-(-n // cfg["BLOCK_N"]),)](
            x, w, x if bias is None else bias, x if norm is None else norm[0], out, out,
            m, n, x.stride(0), w.stride(0), out.stride(0), out.stride(0), n * w.stride(0),
            0.0 if norm is None else norm[1],
            K=k, PAIR=pair, HAS_BIAS=bias is not None, NORM=norm is not None, RESIDUAL=residual is not None,
            **cfg,
        )
    return out
