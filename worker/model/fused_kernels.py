"""The Triton kernels of worker/model/fused.py and fp8_act.py, and the FP8 activation
quantization they share (`group_quant`). This module imports triton: the launchers import it on
first use (fused.py `_kernels`, fp8_act.py `jit`), so the package imports without triton. The
kernels' numerics are described with their launchers.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def group_quant(x):
    """x [G, GROUP] float32 → (x / scale, saturated at ±448 [G, GROUP], scale [G]): the
    group's largest |value| maps to 448; an all-zero group keeps a finite scale."""
    amax = tl.maximum(tl.max(tl.abs(x), 1), 1e-10)
    # div_rn: IEEE division, as torch divides (Triton's `/` is the approximate one).
    scale = tl.math.div_rn(amax, 448.0)  # [G]
    return tl.clamp(tl.math.div_rn(x, scale[:, None]), -448.0, 448.0), scale


@triton.jit
def store_row(y, row, first, out_ptr, stride_out, q_ptr, s_ptr, stride_q, stride_sm, stride_sg,
              END, BLOCK: tl.constexpr, GROUP: tl.constexpr, QUANT: tl.constexpr):
    """y [BLOCK], features first..first + BLOCK of a row (model dtype), into the row of out; or
    (QUANT) quantized per GROUP features for the next FP8 GEMM: e4m3 into q, scales into s."""
    if QUANT:
        g = first // GROUP + tl.arange(0, BLOCK // GROUP)  # [G] the row's groups
        k = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [G, GROUP]
        q, scale = group_quant(tl.reshape(y.to(tl.float32), [BLOCK // GROUP, GROUP]))
        tl.store(q_ptr + row * stride_q + k, q.to(q_ptr.dtype.element_ty), mask=k < END)
        tl.store(s_ptr + row * stride_sm + g * stride_sg, scale, mask=g * GROUP < END)
    else:
        cols = first + tl.arange(0, BLOCK)
        tl.store(out_ptr + row * stride_out + cols, y, mask=cols < END)


@triton.jit
def rms_norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    q_ptr,
    s_ptr,
    stride_x,
    stride_r,
    stride_out,
    stride_res,
    stride_q,
    stride_sm,
    stride_sg,
    eps,
    H: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    QUANT: tl.constexpr,
    GROUP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = (r + x).to(dtype)  # the reference adds in the model dtype
        tl.store(res_out_ptr + row * stride_res + cols, x, mask=mask)
        x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / H + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (x * rstd).to(dtype).to(tl.float32)  # normalized, rounded, then times the weight
    store_row((w * y).to(dtype), row, 0, out_ptr, stride_out, q_ptr, s_ptr, stride_q, stride_sm,
              stride_sg, H, BLOCK, GROUP, QUANT)


@triton.jit
def silu_mul_kernel(
    gu_ptr,
    out_ptr,
    q_ptr,
    s_ptr,
    stride_gu,
    stride_out,
    stride_q,
    stride_sm,
    stride_sg,
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,
    QUANT: tl.constexpr,
    GROUP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)  # F.silu's output, rounded
    store_row((act * up).to(dtype), row, tl.program_id(1) * BLOCK, out_ptr, stride_out, q_ptr,
              s_ptr, stride_q, stride_sm, stride_sg, INTER, BLOCK, GROUP, QUANT)


@triton.jit
def act_quant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    stride_x,
    stride_q,
    stride_sm,
    stride_sg,
    K,
    GROUP: tl.constexpr,
    GROUPS: tl.constexpr,
):
    # One row per program: its groups as a [GROUPS, GROUP] tile (GROUPS a power of two).
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, GROUPS)
    k = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [G, GROUP]
    mask = k < K
    x = tl.load(x_ptr + row * stride_x + k, mask=mask, other=0.0).to(tl.float32)
    q, scale = group_quant(x)
    tl.store(q_ptr + row * stride_q + k, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + g * stride_sg, scale, mask=g * GROUP < K)
