"""Split-K block-scaled FP8 GEMM for small decode batches (1 to 32 tokens) on CUDA.

At decode sizes an FP8 linear is weight streaming: every step reads all of W [N, K] e4m3 for
a few rows of x. cuBLAS's blockwise `_scaled_mm` (fp8_gemm.py) gives one program per output
tile, so the 4096-row projections of an 8B model make 32-96 programs for 132 SMs and read
their weights at 1.0-2.7 TB/s at 16 tokens on an H200. Here:

- **swap AB**: a program's tile is BN weight rows × BM tokens, `dot(W tile [BN, BK],
  x tile [BM, BK]^T)`, so the weights fill the tensor core's M side and the few tokens its N
  side (16 to 64);
- **weights widened, x scaled**: each e4m3 tile is converted to float16 in registers (one
  instruction per pair), and x's block [BM, BK] is multiplied by the tile's block scale (one
  scale per 128 x 128 block: a program's rows share a scale row), so the K loop is one float32
  sum with no per-block rescale of the accumulator and x is not quantized (as the GEMV, unlike
  cuBLAS's recipe). Each iteration loads the next block's x and scale a step ahead;
- **split K**: the grid is (N / BN) × SPLIT; each program walks its share of the K blocks,
  and the last of a tile's SPLIT programs to finish (a per-tile counter, `SplitCounters`) sums
  the partials in split order — deterministic — and writes the output with the bias; it sets
  the counter back to 0, so a CUDA graph replays with no memset.

bench/fp8_splitk.py measures it per projection against cuBLAS and the one-token GEMV (H200,
8B shapes): at 4-16 tokens it reads 1.1-1.8x cuBLAS's GB/s, at 32 tokens 1.2x over a layer's
four projections (gate|up alone 1.02x); at 64 tokens it is behind (the float16 tensor-core work
and the widening grow with the tokens), and at one token the GEMV (worker/model/gemv.py) is
ahead, so `fits` takes 1-32 tokens and the engine's one-token step keeps the GEMV.
x·scale is rounded to float16 (x · 2^-7..2^-12 for typical blocks: well inside its range).
The output is rounded to the model dtype as F.linear's is, then the bias added and rounded.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from worker.model.fp8 import BlockFp8Config
from worker.model.fused import next_pow2

MAX_TOKENS = 32  # the widest x `fits` takes (bench/fp8_splitk.py: behind cuBLAS at 64)
KERNEL_TOKENS = 64  # the widest x the kernel runs (its tile's token side, for the bench)


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
        x_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, part_ptr, cnt_ptr,
        M, N, K, stride_xm, stride_wn, stride_wsn, stride_om,
        STEPS: tl.constexpr, SPLIT: tl.constexpr, SCALE_N: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr,
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
        k_end = tl.minimum(K, kb1 * BK)
        acc = tl.zeros([BN, BM], tl.float32)
        # Iteration kb loads block kb + 1's x and scale (their latency behind this step's dot)
        # and multiplies block kb; the first (kb0 - 1) only loads. Masks are comparisons only
        # (Triton's interpreter widens `bool & scalar bool` to int32).
        xb = tl.zeros([BM, BK], tl.float32)
        sw = 0.0
        for kb in range(kb0 - 1, kb1):
            kn = (kb + 1) * BK + tl.arange(0, BK)
            xn = tl.load(x_rows + kn[None, :], mask=m_mask[:, None] & (kn < k_end)[None, :],
                         other=0.0).to(tl.float32)  # [BM, BK]
            sn = tl.load(s_row + kb + 1, mask=kb + 1 < kb1, other=0.0)
            k = kb * BK + tl.arange(0, BK)
            wmask = n_mask[:, None] & ((k >= kb0 * BK) & (k < K))[None, :]
            w = tl.load(w_rows + k[None, :], mask=wmask, other=0.0)  # [BN, BK] e4m3
            acc = tl.dot(w.to(tl.float16), tl.trans((xb * sw).to(tl.float16)), acc)  # [BN, BM]
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


def fits(m: int, dtype: torch.dtype, quant: BlockFp8Config) -> bool:
    """Whether a CUDA step of m tokens of a linear with this quantization runs here: 1 to 32
    tokens of bf16/fp16 rows, scale blocks whole multiples of the 64-row tile."""
    return 0 < m <= MAX_TOKENS and dtype in (torch.bfloat16, torch.float16) and (
        quant.block_n % 64 == 0)


def default_config(m: int, n: int, k: int, block_k: int) -> dict[str, int]:
    """Tile and split for M tokens against W [N, K]: BN = 64 weight rows, and splits doubled
    while tiles × splits stays within ~4 programs per SM of an H200 (132 SMs) and each split
    keeps ≥ 4 K blocks, at most 4 splits past 16 tokens; 3 pipeline stages. From
    bench/fp8_splitk.py on an H200: at 16 tokens o read 1,762 GB/s with 8 splits and 3 stages
    against 1,538 with 4 and 4 (gate|up level at 1 or 2 splits); at 32 tokens o and down read
    1,407 and 1,918 with 4 splits, 1,158 and 1,692 with 8."""
    tiles = -(-n // 64)
    blocks = -(-k // block_k)
    split = 1
    while tiles * split * 2 <= 528 and blocks // (split * 2) >= 4 and (m <= 16 or split < 4):
        split *= 2
    return dict(BN=64, SPLIT=split, num_warps=4, num_stages=3)


def fp8_splitk(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    quant: BlockFp8Config,
    counters: SplitCounters,
    bias: torch.Tensor | None = None,
    **config: int,
) -> torch.Tensor:
    """x [M ≤ 64, K] (bf16/fp16) @ dequant(w [N, K] e4m3, w_scale)^T (+ bias) → [M, N] in x's
    dtype. `config` overrides default_config (BN, SPLIT, num_warps, num_stages: for sweeps)."""
    m, k = x.shape
    n = w.shape[0]
    if m > KERNEL_TOKENS or w.shape[1] != k or not w.is_contiguous() or x.stride(1) != 1:
        raise ValueError(
            f"fp8_splitk: x [M ≤ {KERNEL_TOKENS}, K] with unit column stride and a contiguous "
            f"w [N, K]; got x {tuple(x.shape)} strides {tuple(x.stride())}, w {tuple(w.shape)}"
        )
    cfg = default_config(m, n, k, quant.block_k) | config
    bn, split = cfg.pop("BN"), cfg.pop("SPLIT")
    if quant.block_n % bn:
        raise ValueError(f"fp8_splitk: BN={bn} must divide the scale block {quant.block_n}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    bm = max(16, next_pow2(m))  # ≥ 16: the tensor core's narrowest N side (Triton's dot)
    tiles = -(-n // bn)
    blocks = -(-k // quant.block_k)
    steps = -(-blocks // split)  # K blocks per split
    part = torch.empty(tiles * split * bn * bm if split > 1 else 1, dtype=torch.float32,
                       device=x.device)
    _kernels().splitk[(tiles, split)](
        x, w, w_scale, x if bias is None else bias, out, part, counters.get(tiles, x.device),
        m, n, k, x.stride(0), w.stride(0), w_scale.stride(0), out.stride(0),
        STEPS=steps, SPLIT=split, SCALE_N=quant.block_n, BM=bm, BN=bn, BK=quant.block_k,
        HAS_BIAS=bias is not None, **cfg,
    )
    return out
