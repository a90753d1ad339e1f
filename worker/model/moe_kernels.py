"""Graph-safe expert compute: rows sorted into per-expert blocks on the device, then one grouped
Triton GEMM per projection; nothing is read on the host.

Why: the eager MoE path picks experts on the host (`unique().tolist()`, split sizes), which a CUDA
graph cannot hold. Here every shape depends only on the number of rows R and of experts E:
`align` sorts the rows by expert and pads each expert's run to BLOCK_M rows with device ops of
static shape (counts by scatter_add, a stable sort, cumsums, searchsorted), giving
`sorted_rows` [S] (a row index, or R for padding) and `block_expert` [S / BLOCK_M] (each block's
expert, -1 past the last used block), with S the worst case R + E*(BLOCK_M-1) rounded up to
BLOCK_M. `grouped_gemm` runs one program per (block, BLOCK_N output columns): it loads its
block's rows, multiplies them by its expert's weight and writes them back to their rows; a
block of expert -1 does nothing. A row whose expert is -1 (an empty slot of the static EP
dispatch) is in no block and comes out zero.

SwiGLU experts (`swiglu_experts`): gate|up GEMM, silu(gate)·up, down GEMM, the math of
`SparseMoEBlock.experts` (worker/model/moe.py), its reference.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import torch.nn.functional as F

BLOCK_M = 16  # rows per block: decode batches put few rows on each expert
BLOCK_N = 64
BLOCK_K = 64


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _kernels() -> SimpleNamespace:
    """Compile-on-first-use: triton is imported only when a grouped GEMM first runs."""
    import triton
    import triton.language as tl

    @triton.jit
    def grouped_gemm_kernel(
        a, w, out, rows, block_expert, R, N, K, stride_am, stride_we, stride_wn, stride_om,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        expert = tl.load(block_expert + pid_m)
        if expert >= 0:
            r = tl.load(rows + pid_m * BM + tl.arange(0, BM))  # [BM] row indices, R = padding
            r_ok = r < R
            n_off = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN]
            n_ok = n_off < N
            w_base = w + expert.to(tl.int64) * stride_we
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(0, K, BK):
                k_off = k0 + tl.arange(0, BK)  # [BK]
                k_ok = k_off < K
                x = tl.load(a + r[:, None] * stride_am + k_off[None, :],
                            mask=r_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
                wt = tl.load(w_base + n_off[None, :] * stride_wn + k_off[:, None],
                             mask=n_ok[None, :] & k_ok[:, None], other=0.0)  # [BK, BN]
                if IEEE:  # float32 weights: full precision, as F.linear computes them
                    acc += tl.dot(x, wt, input_precision="ieee")
                else:
                    acc += tl.dot(x, wt)
            tl.store(out + r[:, None] * stride_om + n_off[None, :],
                     acc.to(out.dtype.element_ty), mask=r_ok[:, None] & n_ok[None, :])

    return SimpleNamespace(grouped_gemm=grouped_gemm_kernel)


def align(local_ids: torch.Tensor, num_experts: int,
          block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """local_ids [R] int64 (-1 = no expert) → (sorted_rows [S] int64, block_expert [S/block_m]
    int64): each expert's rows in a run of whole blocks, padding rows = R (module doc)."""
    r = local_ids.numel()
    dev = local_ids.device
    s = _cdiv(r + num_experts * (block_m - 1), block_m) * block_m  # worst case, static
    key = torch.where(local_ids >= 0, local_ids, num_experts)  # [R]: no expert → bucket E
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))  # [E+1]
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m  # [E] rows incl. padding
    ends = torch.cumsum(padded, 0)  # [E]
    starts = torch.cat([ends - padded, ends.new_full((1,), s)])  # [E+1]: bucket E lands past S
    order = torch.argsort(key, stable=True)  # [R] rows grouped by expert
    sorted_key = key[order]
    first = torch.cumsum(counts, 0) - counts  # [E+1] where each group starts in `order`
    dest = starts[sorted_key] + torch.arange(r, device=dev) - first[sorted_key]  # [R]
    sorted_rows = torch.full((s + r,), r, dtype=torch.int64, device=dev)
    sorted_rows[dest] = order
    block_starts = torch.arange(0, s, block_m, device=dev)  # [S/block_m]
    block_expert = torch.searchsorted(ends, block_starts, right=True)  # [S/block_m] in [0, E]
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return sorted_rows[:s], block_expert


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, sorted_rows: torch.Tensor,
                 block_expert: torch.Tensor, block_m: int = BLOCK_M) -> torch.Tensor:
    """a [R, K] (rows), w [E, N, K] → out [R, N]: each row times its block's expert's weight^T;
    rows in no block stay zero."""
    r, k = a.shape
    n = w.shape[1]
    assert a.stride(1) == 1 and w.stride(2) == 1, "rows and weights must be contiguous in K"
    out = torch.zeros(r, n, dtype=a.dtype, device=a.device)
    grid = (block_expert.numel(), _cdiv(n, BLOCK_N))
    _kernels().grouped_gemm[grid](
        a, w, out, sorted_rows, block_expert, r, n, k, a.stride(0), w.stride(0), w.stride(1),
        out.stride(0), BM=block_m, BN=BLOCK_N, BK=BLOCK_K, IEEE=a.dtype == torch.float32,
    )
    return out


def swiglu_experts(rows: torch.Tensor, local_ids: torch.Tensor, w13: torch.Tensor,
                   w2: torch.Tensor) -> torch.Tensor:
    """rows [R, H], local expert of each row [R] (-1 = none), w13 [E, 2I, H] (gate|up),
    w2 [E, H, I] → each row through its expert [R, H] (zero where the expert is -1)."""
    sorted_rows, block_expert = align(local_ids, w13.shape[0])
    gate_up = grouped_gemm(rows, w13, sorted_rows, block_expert)  # [R, 2I]
    gate, up = gate_up.chunk(2, dim=-1)  # [R, I] each
    act = (F.silu(gate) * up).contiguous()
    return grouped_gemm(act, w2, sorted_rows, block_expert)  # [R, H]
