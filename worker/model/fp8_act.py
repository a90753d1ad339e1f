"""FP8 activations for the block-scaled GEMMs (CUDA; the CPU quantizes with torch).

The DeepSeek-V3 recipe quantizes activations on the fly, per token and 128-wide group of
features: the group's largest |value| maps to 448 (1×128, dynamic). Here:

- `group_quant`, the quantization itself: a Triton function every kernel that writes FP8
  activations calls, so there is one formula (the quantizer below, and the fused norm and
  SiLU·mul epilogues of worker/model/fused.py).
- `quantize_activations(x)`: one kernel over x [M, K] → (e4m3 [M', K], scales [M', K/128]).
- `Fp8Rows`: activations already quantized, laid out as cuBLAS's blockwise `_scaled_mm` takes
  them (rows padded to 4, scales M-major). `Fp8Rows.empty` allocates them for the kernel that
  produces the activations (fused.py's `rms_norm`, `add_rms_norm`, `silu_mul` with `into=`),
  so a step writes its GEMM input once and skips the quantizer's launch
  (worker/model/fp8_gemm.py `input_rows` says when a linear takes its input this way).

Triton is imported lazily. Under `TRITON_INTERPRET=1` on CPU tensors activations are quantized
by torch: Triton 3.9's interpreter rounds float32 → e4m3 without the carry into the exponent
(31.9 → 16) and without saturating.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn.functional as F

from worker.model.fp8 import FP8, FP8_MAX

GROUP = 128  # features per activation scale (the recipe's 1×128)
PAD_ROWS = 4  # cuBLAS reads A's scales M-major in 16-byte units: rows padded to 4


class Fp8Rows(NamedTuple):
    """x [M, K] quantized for cuBLAS's blockwise GEMM: `q` e4m3 [M', K] and `scales` float32
    [M', K/128] M-major (M' = M rounded up to PAD_ROWS; rows past M are never read back), `rows`
    = M, `dtype` = x's dtype (the GEMM's output dtype)."""

    q: torch.Tensor
    scales: torch.Tensor
    rows: int
    dtype: torch.dtype

    @staticmethod
    def empty(m: int, k: int, dtype: torch.dtype, device: torch.device) -> Fp8Rows:
        q, s = _buffers(m, k, GROUP, PAD_ROWS, True, device)
        return Fp8Rows(q, s, m, dtype)


@functools.cache
def jit() -> ModuleType:
    """The quantizer's kernel and `group_quant` (worker/model/fused_kernels.py: they import
    triton, on first use)."""
    from worker.model import fused_kernels

    return fused_kernels


def _buffers(
    m: int, k: int, group: int, pad_rows: int, m_major: bool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    groups = -(-k // group)
    rows = -(-m // pad_rows) * pad_rows
    q = torch.empty((rows, k), dtype=FP8, device=device)
    if m_major:
        return q, torch.empty((groups, rows), dtype=torch.float32, device=device).t()  # [M', G]
    return q, torch.empty((rows, groups), dtype=torch.float32, device=device)  # [M', G]


def quantize_activations(
    x: torch.Tensor, group: int = GROUP, pad_rows: int = 1, m_major: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (e4m3 [M', K], scales [M', ceil(K/group)] float32): per token and group of
    `group` features, the largest |value| maps to 448 (dynamic activation scaling). M' is M
    rounded up to a multiple of `pad_rows`; the rows past M are not written (their products
    are sliced off). `m_major`: the scales laid out M-major, as cuBLAS's blockwise scaled_mm
    takes them (the Triton GEMM reads either; row-major, its loads run faster: at M = 64 the
    qkv projection ran at 200 TFLOP/s with row-major scales, 125 with M-major)."""
    m, k = x.shape
    q, s = _buffers(m, k, group, pad_rows, m_major, x.device)
    if x.device.type != "cuda":  # torch ops (also under Triton's interpreter: see the module doc)
        groups = s.shape[1]
        xg = F.pad(x.float(), (0, groups * group - k)).view(m, -1, group)  # [M, G, group]
        s[:m].copy_(xg.abs().amax(-1).clamp(min=1e-10) / FP8_MAX)
        q[:m].copy_((xg / s[:m, :, None]).clamp(-FP8_MAX, FP8_MAX).view(m, -1)[:, :k].to(FP8))
        return q, s
    if x.stride(1) != 1:
        x = x.contiguous()
    if m:
        padded = 1 << (s.shape[1] - 1).bit_length()
        jit().act_quant_kernel[(m,)](
            x, q, s, x.stride(0), q.stride(0), s.stride(0), s.stride(1), k,
            GROUP=group, GROUPS=padded, num_warps=8 if padded * group > 8192 else 4,
        )
    return q, s
