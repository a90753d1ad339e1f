"""Split-K block-scaled FP8 GEMM for small decode batches (1 to 64 tokens) on CUDA.

At decode sizes an FP8 linear is weight streaming: every step reads all of W [N, K] e4m3 for
a few rows of x. cuBLAS's blockwise `_scaled_mm` (fp8_gemm.py) gives one program per output
tile, so the 4096-row projections of an 8B model make 32-96 programs for 132 SMs and read
their weights at 1.0-2.9 TB/s at 16-64 tokens on an H200. Here:

- **swap AB**: a program's tile is BN weight rows × BM tokens, `dot(W tile [BN, BK],
  x tile [BM, BK]^T)`, so the weights fill the tensor core's M side and the few tokens its N
  side (16 to 64);
- **split K**: the grid is (N / BN) × SPLIT; each program walks its share of the K blocks,
  and the last of a tile's SPLIT programs to finish (a per-tile counter, `SplitCounters`) sums
  the partials in split order — deterministic — and writes the output with the bias; it sets
  the counter back to 0, so a CUDA graph replays with no memset.

Two ways to feed the tensor cores, by the step's tokens (`mode`):
- **x as it is, up to 32 tokens (`Mode.WIDENED`)**: each e4m3 tile is converted to float16 in
  registers (one instruction per pair), and x's block [BM, BK] is multiplied by the tile's
  block scale (one scale per 128 x 128 block: a program's rows share a scale row), so the K
  loop is one float32 sum with no per-block rescale and x is not quantized (as the GEMV).
  Each iteration loads the next block's x and scale a step ahead. x·scale is rounded to
  float16 (x · 2^-7..2^-12 for typical blocks: well inside its range).
- **x quantized, 33 to 64 tokens (`Mode.QUANTIZED`)**: x comes as `Fp8Rows` (the DeepSeek
  recipe's 1×128 activation scales, written by the kernel before: fp8_act.py), and each K
  block is one e4m3 × e4m3 tensor-core dot (wgmma), rescaled by its weight block's scale times
  each token's group scale into the float32 sum: no widening, which grows with the tokens.

bench/fp8_splitk.py measures both per projection against cuBLAS and the one-token GEMV (H200,
8B shapes): widened, at 4-16 tokens it reads 1.1-1.8x cuBLAS's GB/s and at 32 tokens 1.2x over
a layer's four projections, but at 64 it is behind cuBLAS (the float16 dots and the widening
grow with the tokens); quantized, at 64 tokens it reads 1.09-1.53x cuBLAS's GB/s on the same
quantized x. At one token the GEMV (worker/model/gemv.py) is ahead of both, so `fits` takes
1-64 tokens and the engine's one-token step keeps the GEMV.
The output is rounded to the model dtype as F.linear's is, then the bias added and rounded.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from worker.arch.fp8_config import BlockFp8Config
from worker.model.fp8_act import GROUP, Fp8Rows
from worker.model.fused import next_pow2

MAX_TOKENS = 64  # the widest x the kernel runs (its tile's token side) and `fits` takes
WIDENED_TOKENS = 32  # up to here x is read as it is (bench/fp8_splitk.py: behind cuBLAS at 64)


class Mode(enum.Enum):
    """How a step's x meets the e4m3 weights (module docstring; `mode` picks by tokens)."""

    WIDENED = "widened"  # x [M, K] as it is; weight tiles widened to float16
    QUANTIZED = "quantized"  # x as Fp8Rows (1×128 scales); e4m3 × e4m3 dots


@dataclass
class SplitCounters:
    """One int32 per output tile, zero between calls (the kernel's last program resets its own).
    A linear owns one; it is created on first use, outside CUDA-graph capture in the engine
    (its warm-up runs every shape eagerly first); inside a capture the zeroing is captured too.
    Two calls of one linear must not run at once on two streams (they would share counters):
    a worker runs its forwards on one stream."""

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
        x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, part_ptr, cnt_ptr,
        M, N, K, stride_xm, stride_xsm, stride_xsg, stride_wn, stride_wsn, stride_om,
        STEPS: tl.constexpr, SPLIT: tl.constexpr, SCALE_N: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr,
        QUANTIZED: tl.constexpr,
    ):
        tile = tl.program_id(0)
        split = tl.program_id(1)
        n = tile * BN + tl.arange(0, BN)  # [BN] output features
        m = tl.arange(0, BM)  # [BM] tokens
        n_mask, m_mask = n < N, m < M
        x_rows = x_ptr + m[:, None] * stride_xm  # [BM, 1]
        w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn  # [BN, 1]
        s_row = ws_ptr + (tile * BN // SCALE_N) * stride_wsn  # this tile's row of block scales
        kb0 = split * STEPS
        kb1 = tl.minimum(kb0 + STEPS, tl.cdiv(K, BK))
        acc = tl.zeros([BN, BM], tl.float32)
        # Masks are comparisons only (Triton's interpreter widens `bool & scalar bool` to int32).
        if QUANTIZED:  # x e4m3 [M', K] with scales xs [M', K/BK]: one e4m3 dot per K block
            for kb in range(kb0, kb1):
                k = kb * BK + tl.arange(0, BK)
                w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & (k < K)[None, :],
                            other=0.0)  # [BN, BK] e4m3
                xq = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & (k < K)[None, :],
                             other=0.0)  # [BM, BK] e4m3
                xs = tl.load(xs_ptr + m * stride_xsm + kb * stride_xsg, mask=m_mask,
                             other=0.0)  # [BM]
                acc += tl.dot(w, tl.trans(xq)) * (xs * tl.load(s_row + kb))[None, :]
        else:
            # Iteration kb loads block kb + 1's x and scale (their latency behind this step's
            # dot) and multiplies block kb; the first (kb0 - 1) only loads.
            k_end = tl.minimum(K, kb1 * BK)
            xb = tl.zeros([BM, BK], tl.float32)
            sw = 0.0
            for kb in range(kb0 - 1, kb1):
                kn = (kb + 1) * BK + tl.arange(0, BK)
                xn = tl.load(x_rows + kn[None, :],
                             mask=m_mask[:, None] & (kn < k_end)[None, :],
                             other=0.0).to(tl.float32)  # [BM, BK]
                sn = tl.load(s_row + kb + 1, mask=kb + 1 < kb1, other=0.0)
                k = kb * BK + tl.arange(0, BK)
                wmask = n_mask[:, None] & ((k >= kb0 * BK) & (k < K))[None, :]
                w = tl.load(w_rows + k[None, :], mask=wmask, other=0.0)  # [BN, BK] e4m3
                acc = tl.dot(w.to(tl.float16), tl.trans((xb * sw).to(tl.float16)), acc)
                xb, sw = xn, sn
        last = True
        if SPLIT > 1:  # park the partials; the tile's last program sums them in split order
            cell = tl.arange(0, BN)[:, None] * BM + m[None, :]  # [BN, BM]
            base = part_ptr + tile * (SPLIT * BN * BM)
            tl.store(base + split * (BN * BM) + cell, acc)
            tl.debug_barrier()  # every thread's partial written before the count moves
            last = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
            if last:
                acc = tl.zeros([BN, BM], tl.float32)
                for s in range(SPLIT):  # L2 reads (.cg): other SMs wrote them
                    acc += tl.load(base + s * (BN * BM) + cell, cache_modifier=".cg")
                tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next call (a graph replay)
        if last:  # [BN, BM] sums → out[m, n], rounded as F.linear's output, then the bias
            dtype = out_ptr.dtype.element_ty
            y = acc.to(dtype)
            if HAS_BIAS:
                y = y.to(tl.float32) + tl.load(b_ptr + n, mask=n_mask, other=0.0).to(
                    tl.float32
                )[:, None]
            tl.store(out_ptr + m[None, :] * stride_om + n[:, None], y.to(dtype),
                     mask=n_mask[:, None] & m_mask[None, :])

    return SimpleNamespace(splitk=splitk_kernel)


def mode(m: int) -> Mode:
    """How a step of m tokens runs here: x as it is up to WIDENED_TOKENS, quantized past it."""
    return Mode.WIDENED if m <= WIDENED_TOKENS else Mode.QUANTIZED


def fits(m: int, dtype: torch.dtype, quant: BlockFp8Config) -> bool:
    """Whether a CUDA step of m tokens of a linear with this quantization runs here: 1 to 64
    tokens of bf16/fp16 rows, scale blocks whole multiples of the 64-row tile; past 32 tokens
    (x quantized) K blocks as wide as the activations' groups."""
    return (
        0 < m <= MAX_TOKENS
        and dtype in (torch.bfloat16, torch.float16)
        and quant.block_n % 64 == 0
        and (mode(m) is Mode.WIDENED or quant.block_k == GROUP)
    )


def default_config(m: int, n: int, k: int, block_k: int) -> dict[str, int]:
    """Tile and split for M tokens against W [N, K]: BN = 64 weight rows, and splits doubled
    while tiles × splits stays within ~4 programs per SM of an H200 (132 SMs) and each split
    keeps ≥ 4 K blocks, at most 4 splits past 16 tokens; 3 pipeline stages. From
    bench/fp8_splitk.py on an H200: at 16 tokens o read 1,762 GB/s with 8 splits and 3 stages
    against 1,538 with 4 and 4 (gate|up level at 1 or 2 splits); at 32 tokens o and down read
    1,407 and 1,918 with 4 splits, 1,158 and 1,692 with 8. Quantized, at 64 tokens, the same
    rule picked each projection's best of BN 64/128, 1-8 splits and 3/4/6 stages."""
    tiles = -(-n // 64)
    blocks = -(-k // block_k)
    split = 1
    while tiles * split * 2 <= 528 and blocks // (split * 2) >= 4 and (m <= 16 or split < 4):
        split *= 2
    return dict(BN=64, SPLIT=split, num_warps=4, num_stages=3)


def fp8_splitk(
    x: torch.Tensor | Fp8Rows,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    quant: BlockFp8Config,
    counters: SplitCounters,
    bias: torch.Tensor | None = None,
    **config: int,
) -> torch.Tensor:
    """x [M ≤ 64, K] (bf16/fp16, or quantized as Fp8Rows) @ dequant(w [N, K] e4m3,
    w_scale)^T (+ bias) → [M, N] in x's dtype. `config` overrides default_config (BN, SPLIT,
    num_warps, num_stages: for sweeps)."""
    if isinstance(x, Fp8Rows):
        xv, xs, m, dtype, quantized = x.q, x.scales, x.rows, x.dtype, True
    else:
        xv, xs, m, dtype, quantized = x, x, x.shape[0], x.dtype, False
    k = xv.shape[1]
    n = w.shape[0]
    if m > MAX_TOKENS or w.shape[1] != k or not w.is_contiguous() or xv.stride(1) != 1:
        raise ValueError(
            f"fp8_splitk: x [M ≤ {MAX_TOKENS}, K] with unit column stride and a contiguous "
            f"w [N, K]; got x {tuple(xv.shape)} strides {tuple(xv.stride())}, "
            f"w {tuple(w.shape)}"
        )
    if quantized and quant.block_k != GROUP:
        raise ValueError(f"fp8_splitk: quantized x needs {GROUP}-wide K blocks, got "
                         f"{quant.block_k}")
    cfg = default_config(m, n, k, quant.block_k) | config
    bn, split = cfg.pop("BN"), cfg.pop("SPLIT")
    if quant.block_n % bn:
        raise ValueError(f"fp8_splitk: BN={bn} must divide the scale block {quant.block_n}")
    out = torch.empty((m, n), dtype=dtype, device=xv.device)
    if m == 0:
        return out
    bm = max(16, next_pow2(m))  # ≥ 16: the tensor core's narrowest N side (Triton's dot)
    tiles = -(-n // bn)
    blocks = -(-k // quant.block_k)
    steps = -(-blocks // split)  # K blocks per split
    part = torch.empty(tiles * split * bn * bm if split > 1 else 1, dtype=torch.float32,
                       device=xv.device)
    _kernels().splitk[(tiles, split)](
        xv, xs, w, w_scale, xv if bias is None else bias, out, part,
        counters.get(tiles, xv.device), m, n, k, xv.stride(0), xs.stride(0), xs.stride(-1),
        w.stride(0), w_scale.stride(0), out.stride(0),
        STEPS=steps, SPLIT=split, SCALE_N=quant.block_n, BM=bm, BN=bn, BK=quant.block_k,
        HAS_BIAS=bias is not None, QUANTIZED=quantized, **cfg,
    )
    return out
