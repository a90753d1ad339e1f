"""Triton GEMV for single-token steps (decode at batch 1): y = W x for one row x (CUDA).

At batch 1 a decode step is weight streaming: every projection reads its whole matrix for one
row of output. cuBLAS's M = 1 kernels read the 4096-wide projections (qkv, o, down) at
2.5–3.4 TB/s on an H200, below the ~4.25 TB/s copy rate. Here each program owns a few whole
output rows. With a norm folded in (K ≤ 8192: every hidden size up to 70B-class models) it
loads its weight rows and x in one go and reduces once; otherwise it walks K in 2048-wide
contiguous blocks. Weights are read once and evicted first. bench/gemv.py measures it against
cuBLAS per projection.

Because a program holds all of x, the layer's glue folds in (worker/model/llama.py
`DecoderLayer.forward_stream`):
- `norm=(weight, eps)`: x is the residual stream; the program RMSNorms it on the fly, exactly
  as layers.RMSNorm does (float32 statistics, rounded where it rounds).
- `residual=stream`: y is added to the stream in place (the residual add of the next norm).
- `pair=True`: w is the fused gate|up weight; y = silu(gate) * up (SwiGLU).
- `out` may be float32 (logits): y is rounded to the model dtype first, as F.linear(...).float().
- `w_scale=, block=`: w is a block-scaled FP8 weight (worker/model/fp8.py). A program's rows
  lie in one block row of scales (BLOCK_N divides block_n), so w·s·x = w·(x·s): the program
  scales its row of x by that block row (BLOCK_K multiplies, not BLOCK_N × BLOCK_K) and then
  runs the plain GEMV over the e4m3 tile. A step streams one byte per weight plus 1/16384 of
  that in scales, and x stays unquantized (float32 in registers).
Sums run in float32 in another order than cuBLAS's: results agree with F.linear to bf16
rounding, not bit for bit.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from worker.model.fused import next_pow2

MAX_K_ONE_BLOCK = 8192  # widest x a program holds whole (past it, K blocks: a norm's statistics
# then come from a first pass over x)
_LOOP_BLOCK_K = 2048  # K block of the looping kernel (wider K: down projections)


def _config(k: int, pair: bool, norm: bool, fp8: bool) -> dict[str, int]:
    """Block shape and launch settings, swept on an H200 for each way the engine calls it
    (bench/gemv.py --sweep, K = 4096): with a norm, K in one block up to MAX_K_ONE_BLOCK wide (4
    rows per program, fewer past 4096 wide so a program holds at most 16k weights, or 1 gate|up
    pair; 8 warps); otherwise 4 rows per program over 2048-wide blocks (8 warps up to 8192 wide,
    4 past it). FP8 weights (bench/gemv.py --fp8 --sweep): twice the rows per program (8; 4
    gate|up pairs), K whole up to 4096 wide or with a norm up to MAX_K_ONE_BLOCK (8 warps),
    else 1024-wide blocks (4 warps). A K block narrower than K with a norm folded in costs the
    norm's statistics a first pass over x."""
    one_block_norm = norm and k <= MAX_K_ONE_BLOCK
    if fp8:
        if one_block_norm or k <= 4096:
            return dict(BLOCK_N=4 if pair else 8, BLOCK_K=next_pow2(k), num_warps=8, num_stages=1)
        return dict(BLOCK_N=4 if pair else 8, BLOCK_K=1024, num_warps=4, num_stages=2)
    if one_block_norm:
        block_k = next_pow2(k)
        return dict(
            BLOCK_N=1 if pair else max(1, min(4, 16384 // block_k)),
            BLOCK_K=block_k,
            num_warps=8,
            num_stages=1,
        )
    return dict(
        BLOCK_N=2 if pair else 4,
        BLOCK_K=_LOOP_BLOCK_K,
        num_warps=8 if k <= MAX_K_ONE_BLOCK else 4,
        num_stages=2,
    )


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit
    def gemv_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        nw_ptr,
        r_ptr,
        out_ptr,
        s_ptr,
        N,
        stride_w,
        pair_offset,
        eps,
        stride_s,
        K: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PAIR: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        NORM: tl.constexpr,
        RESIDUAL: tl.constexpr,
        SCALED: tl.constexpr,
        SCALE_N: tl.constexpr,
        SCALE_K: tl.constexpr,
    ):
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output features
        k = tl.arange(0, BLOCK_K)  # [BK]
        n_mask = n < N
        dtype = x_ptr.dtype.element_ty
        # FP8: the scale rows of this program's rows and of their up half (one each, see gemv())
        s_row = s_ptr + (tl.program_id(0) * BLOCK_N // SCALE_N) * stride_s
        su_row = s_ptr + ((tl.program_id(0) * BLOCK_N + N) // SCALE_N) * stride_s

        w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_w  # [BN, 1]
        if BLOCK_K >= K:  # one block: weight rows first (the long wait), then x beside them
            k_mask = k < K
            mask = n_mask[:, None] & k_mask[None, :]
            w = tl.load(w_rows + k[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
            if PAIR:
                u = tl.load(
                    w_rows + pair_offset + k[None, :],
                    mask=mask,
                    other=0.0,
                    eviction_policy="evict_first",
                )
            x = tl.load(x_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
            if NORM:
                # as layers.RMSNorm: float32 statistics;
                # normalized, rounded, times the weight, rounded
                rstd = tl.rsqrt(tl.sum(x * x, 0) / K + eps)
                nw = tl.load(nw_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
                x = (nw * (x * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            xu = x  # the up half's x (PAIR)
            if SCALED:  # x times the block scale of each column: [BK]
                if PAIR:
                    xu = x * tl.load(su_row + k // SCALE_K, mask=k_mask, other=0.0)
                x = x * tl.load(s_row + k // SCALE_K, mask=k_mask, other=0.0)
            y = tl.sum(w.to(tl.float32) * x[None, :], 1)  # [BN]
            if PAIR:
                up = tl.sum(u.to(tl.float32) * xu[None, :], 1)
        else:  # K blocks; a 2-D partial sum, reduced once after the loop
            if NORM:  # the statistics first, in a pass over x (small, and in L2)
                sq = tl.zeros([BLOCK_K], dtype=tl.float32)
                for i in range(0, tl.cdiv(K, BLOCK_K)):
                    kk = i * BLOCK_K + k
                    xs = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
                    sq += xs * xs
                rstd = tl.rsqrt(tl.sum(sq, 0) / K + eps)
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            for i in range(0, tl.cdiv(K, BLOCK_K)):
                kk = i * BLOCK_K + k
                k_mask = kk < K
                mask = n_mask[:, None] & k_mask[None, :]
                w = tl.load(
                    w_rows + kk[None, :], mask=mask, other=0.0, eviction_policy="evict_first"
                )
                x = tl.load(x_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
                if NORM:
                    nw = tl.load(nw_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
                    x = (nw * (x * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
                xu = x
                if SCALED:
                    if PAIR:
                        xu = x * tl.load(su_row + kk // SCALE_K, mask=k_mask, other=0.0)
                    x = x * tl.load(s_row + kk // SCALE_K, mask=k_mask, other=0.0)
                acc += w.to(tl.float32) * x[None, :]
                if PAIR:
                    u = tl.load(
                        w_rows + pair_offset + kk[None, :],
                        mask=mask,
                        other=0.0,
                        eviction_policy="evict_first",
                    )
                    acc_up += u.to(tl.float32) * xu[None, :]
            y = tl.sum(acc, 1)
            if PAIR:
                up = tl.sum(acc_up, 1)
        if HAS_BIAS:
            y = y.to(dtype).to(tl.float32) + tl.load(b_ptr + n, mask=n_mask, other=0.0).to(
                tl.float32
            )
        y = y.to(dtype).to(tl.float32)  # rounded as F.linear's output is
        if PAIR:  # SwiGLU: silu(gate), rounded, times up
            if HAS_BIAS:
                up = up.to(dtype).to(tl.float32) + tl.load(
                    b_ptr + N + n, mask=n_mask, other=0.0
                ).to(tl.float32)
            up = up.to(dtype).to(tl.float32)
            y = ((y * tl.sigmoid(y)).to(dtype).to(tl.float32) * up).to(dtype).to(tl.float32)
        if RESIDUAL:  # the residual stream plus this output, in the model dtype
            y = (tl.load(r_ptr + n, mask=n_mask, other=0.0).to(tl.float32) + y).to(dtype)
        tl.store(out_ptr + n, y, mask=n_mask)

    return SimpleNamespace(gemv=gemv_kernel)


def _row(t: torch.Tensor, width: int, name: str) -> None:
    if t.shape != (1, width) or t.stride(1) != 1:
        raise ValueError(
            f"{name} must be one row [1, {width}] with unit column stride; got {tuple(t.shape)} "
            f"strides {tuple(t.stride())}"
        )


def gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    pair: bool = False,
    norm: tuple[torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    block: tuple[int, int] = (128, 128),
    **config: int,
) -> torch.Tensor:
    """y = x w^T (+ bias) for one row x [1, K] and a contiguous w [N, K] of x's dtype → [1, N]
    (into `out`, or into `residual`, whose row it adds to in place); see the module docstring.
    An FP8 w takes its block scales `w_scale` [N / block[0], K / block[1]] float32.
    `config` overrides the block shape (BLOCK_N, BLOCK_K, num_warps, num_stages: for sweeps)."""
    rows, k = w.shape
    _row(x, k, "x")
    if not w.is_contiguous() or (x.dtype != w.dtype and w_scale is None):
        raise ValueError(
            f"w must be a contiguous [N, K] of x's dtype {x.dtype} (or FP8 with "
            "w_scale); got "
            f"{w.dtype} strides {tuple(w.stride())}"
        )
    if w_scale is not None and (
        w_scale.shape != (-(-rows // block[0]), -(-k // block[1]))
        or w_scale.dtype != torch.float32
        or w_scale.stride(1) != 1
    ):
        raise ValueError(
            f"w_scale must be float32 [{-(-rows // block[0])}, {-(-k // block[1])}] "
            f"(blocks {block}), got {tuple(w_scale.shape)} {w_scale.dtype}"
        )
    if pair and rows % 2:
        raise ValueError(
            f"gemv(pair=True) needs the fused gate|up weight (an even row count), got {rows}"
        )
    n = rows // 2 if pair else rows
    if bias is not None and bias.shape != (rows,):
        raise ValueError(f"bias must be [{rows}], got {tuple(bias.shape)}")
    if norm is not None and norm[0].shape != (k,):
        raise ValueError(f"norm weight must be [{k}], got {tuple(norm[0].shape)}")
    if residual is not None:
        _row(residual, n, "residual")
        if residual.dtype != x.dtype:
            raise ValueError(f"residual must be {x.dtype}, got {residual.dtype}")
        out = residual
    elif out is None:
        out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    else:
        _row(out, n, "out")
    cfg = _config(k, pair, norm is not None, w_scale is not None) | config
    if w_scale is not None and (block[0] % cfg["BLOCK_N"] or (pair and n % cfg["BLOCK_N"])):
        cfg["BLOCK_N"] = 1  # a program's rows (and their up half's) must share one scale row
    _kernels().gemv[(-(-n // cfg["BLOCK_N"]),)](
        x,
        w,
        x if bias is None else bias,
        x if norm is None else norm[0],
        out,
        out,
        x if w_scale is None else w_scale,
        n,
        w.stride(0),
        n * w.stride(0),
        0.0 if norm is None else norm[1],
        0 if w_scale is None else w_scale.stride(0),
        K=k,
        PAIR=pair,
        HAS_BIAS=bias is not None,
        NORM=norm is not None,
        RESIDUAL=residual is not None,
        SCALED=w_scale is not None,
        SCALE_N=block[0],
        SCALE_K=block[1],
        **cfg,
    )
    return out
