"""Fused Triton kernels for the decoder's elementwise work between its matmuls (CUDA).

In plain torch each of these jobs is several kernels — casts to float32, pow, mean, rsqrt,
multiplies, a cat for rotate-half — and at decode batch 1 those small kernels cost as much GPU
time as the weight matmuls they sit between. Here each job is one kernel:

- `rms_norm(x, weight, eps)`: RMSNorm of each row.
- `add_rms_norm(x, residual, weight, eps)`: the residual add fused into the next norm (as vLLM
  and SGLang do): returns (norm(residual + x), residual + x) from one read of each input.
- `silu_mul(gate_up)`: SwiGLU's silu(gate) * up from the fused gate|up projection.
- `qk_norm_rope` (worker/model/fused_rope.py): q/k norm, RoPE and the K/V store in one kernel.

Numerics follow the torch reference step by step (layers.py `RMSNorm`, rope.py `apply_rope`,
llama.py `MLP`): float32 math, rounded to the model dtype wherever the reference rounds (the
sum before the norm, the normalized row before the weight multiply, silu before the up
multiply), so a fused model's greedy tokens match the unfused one's. The torch code stays the
CPU reference; `available(device)` says where these kernels run. The kernels take any tensor
Triton can address, so `TRITON_INTERPRET=1` runs them on CPU tensors for debugging.
"""

from __future__ import annotations

import functools
import importlib.util
from types import SimpleNamespace

import torch

_NORM_MAX_BLOCK = 1 << 16  # widest row one norm program holds in registers (hidden sizes are ≤ 16k)
_SILU_BLOCK = 1024  # features per silu_mul program


def available(device: torch.device | str) -> bool:
    """Whether the fused kernels can run on `device`: CUDA with triton importable."""
    return torch.device(device).type == "cuda" and importlib.util.find_spec("triton") is not None


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _kernels() -> SimpleNamespace:
    """Compile-on-first-use: triton is imported only when a fused kernel first runs."""
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_kernel(
        x_ptr,
        r_ptr,
        w_ptr,
        out_ptr,
        res_out_ptr,
        stride_x,
        stride_r,
        stride_out,
        stride_res,
        eps,
        H: tl.constexpr,
        BLOCK: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
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
        tl.store(out_ptr + row * stride_out + cols, (w * y).to(dtype), mask=mask)

    @triton.jit
    def silu_mul_kernel(
        gu_ptr,
        out_ptr,
        stride_gu,
        stride_out,
        INTER: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < INTER
        dtype = out_ptr.dtype.element_ty
        gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gu_ptr + row * stride_gu + INTER + cols, mask=mask, other=0.0).to(tl.float32)
        act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)  # F.silu's output, rounded
        tl.store(out_ptr + row * stride_out + cols, (act * up).to(dtype), mask=mask)

    return SimpleNamespace(rms_norm=rms_norm_kernel, silu_mul=silu_mul_kernel)


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """x [..., H] as a 2-D [N, H] view with unit stride along H (copies only if it must)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        raise ValueError(
            f"{name}: the last dimension must have stride 1, got strides {tuple(x.stride())}"
        )
    return x2


def _output(
    like: torch.Tensor, shape: tuple[int, ...], out: torch.Tensor | None, name: str
) -> torch.Tensor:
    """A caller's output tensor (checked) or a new one: [N, W] rows with unit column stride."""
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if (
        tuple(out.shape) != shape
        or out.dtype != like.dtype
        or out.device != like.device
        or out.stride(-1) != 1
    ):
        raise ValueError(
            f"{name} must be {shape} {like.dtype} on {like.device} with unit column stride; "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}, strides {tuple(out.stride())}"
        )
    return out


def _norm_launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None,
    residual_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(
            f"RMSNorm weight has shape {tuple(weight.shape)}, x's rows have {hidden} features"
        )
    block = next_pow2(hidden)
    if block > _NORM_MAX_BLOCK:
        raise ValueError(
            f"fused RMSNorm holds rows of up to {_NORM_MAX_BLOCK} features, got {hidden}; "
            "run the model unfused (set_fused_kernels(False))"
        )
    x2 = _rows(x, "x")  # [N, H]
    out2 = _output(x2, tuple(x2.shape), None if out is None else _rows(out, "out"), "out")
    r2 = res2 = out2  # placeholders the kernel ignores without a residual
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"residual {tuple(residual.shape)} {residual.dtype} must match x "
                f"{tuple(x.shape)} {x.dtype}"
            )
        r2 = _rows(residual, "residual")
        res_given = None if residual_out is None else _rows(residual_out, "residual_out")
        res2 = _output(x2, tuple(x2.shape), res_given, "residual_out")
    if x2.shape[0]:
        _kernels().rms_norm[(x2.shape[0],)](
            x2,
            r2,
            weight,
            out2,
            res2,
            x2.stride(0),
            r2.stride(0),
            out2.stride(0),
            res2.stride(0),
            eps,
            H=hidden,
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            num_warps=min(16, max(1, block // 512)),
        )
    return out2.view(x.shape), res2.view(x.shape)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., H] → RMSNorm(x) * weight in x's dtype (float32 statistics), into `out` if given."""
    return _norm_launch(x, None, weight, eps, out, None)[0]


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., H] → (RMSNorm(residual + x) * weight, residual + x), both in x's dtype."""
    return _norm_launch(x, residual, weight, eps, out, residual_out)


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [T, 2I] (gate first, then up) → silu(gate) * up [T, I] in gate_up's dtype."""
    t, width = gate_up.shape
    if width % 2:
        raise ValueError(f"silu_mul needs the fused gate|up output (an even width), got {width}")
    inter = width // 2
    gu = _rows(gate_up, "gate_up")
    out = _output(gate_up, (t, inter), out, "out")  # [T, I]
    if t:
        block = min(_SILU_BLOCK, next_pow2(inter))
        _kernels().silu_mul[(t, _cdiv(inter, block))](
            gu,
            out,
            gu.stride(0),
            out.stride(0),
            INTER=inter,
            BLOCK=block,
            num_warps=4,
        )
    return out
