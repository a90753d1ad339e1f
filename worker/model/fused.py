"""Fused Triton kernels for the decoder's elementwise work between its matmuls (CUDA).

In plain torch each of these jobs is several kernels — casts to float32, pow, mean, rsqrt,
multiplies, a cat for rotate-half — and at decode batch 1 those small kernels cost as much GPU
time as the weight matmuls they sit between. Here each job is one kernel:

- `rms_norm(x, weight, eps)`: RMSNorm of each row.
- `add_rms_norm(x, residual, weight, eps)`: the residual add fused into the next norm (as vLLM
  and SGLang do): returns (norm(residual + x), residual + x) from one read of each input.
- `silu_mul(gate_up)`: SwiGLU's silu(gate) * up from the fused gate|up projection.
- `into=` (the three above): the output quantized per token and 128 features for the next FP8
  GEMM (worker/model/fp8_act.py `Fp8Rows`) in place of the row, so the step has no quantizer
  launch between the kernel and cuBLAS.
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
from types import ModuleType
from typing import overload

import torch

from worker.model import fp8_act
from worker.model.fp8_act import Fp8Rows

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
def _kernels() -> ModuleType:
    """Compile-on-first-use: triton is imported only when a fused kernel first runs."""
    from worker.model import fused_kernels

    return fused_kernels


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
    into: Fp8Rows | None = None,
) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
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
    if into is None:
        out2 = _output(x2, tuple(x2.shape), None if out is None else _rows(out, "out"), "out")
    else:  # out2 a placeholder: the kernel writes `into`, in whole 128-feature groups
        out2 = x2
        block = max(block, fp8_act.GROUP)
    q, s = _quant_target(into, x2, hidden, block)
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
        _kernels().rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out2, res2, q, s,
            x2.stride(0), r2.stride(0), out2.stride(0), res2.stride(0),
            q.stride(0), s.stride(0), s.stride(1),
            eps,
            H=hidden,
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            QUANT=into is not None,
            GROUP=fp8_act.GROUP,
            num_warps=min(16, max(1, block // 512)),
        )
    return (out2.view(x.shape) if into is None else into), res2.view(x.shape)


def _quant_target(
    into: Fp8Rows | None, like: torch.Tensor, width: int, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`into`'s e4m3 rows and scales, checked against the kernel's output [rows of like, width]
    in like's dtype (without `into`: like twice, placeholders the kernel ignores)."""
    rows, dtype = like.shape[0], like.dtype
    if into is None:
        return like, like
    if (
        into.rows != rows
        or into.q.shape[0] < rows
        or into.q.shape[1] != width
        or into.scales.shape[1] != -(-width // fp8_act.GROUP)
        or into.dtype != dtype
        or block % fp8_act.GROUP
    ):
        raise ValueError(
            f"into must be Fp8Rows.empty({rows}, {width}, {dtype}) for rows of {width} features "
            f"in blocks of whole {fp8_act.GROUP}-feature groups; got q {tuple(into.q.shape)}, "
            f"scales {tuple(into.scales.shape)}, {into.rows} rows of {into.dtype}"
        )
    return into.q, into.scales


@overload
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
    into: None = None,
) -> torch.Tensor: ...
@overload
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: None = None, *, into: Fp8Rows
) -> Fp8Rows: ...
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
    into: Fp8Rows | None = None,
) -> torch.Tensor | Fp8Rows:
    """x [..., H] → RMSNorm(x) * weight in x's dtype (float32 statistics), into `out` if given;
    with `into` (fp8_act.Fp8Rows), quantized for the next FP8 GEMM instead, and `into` returned.
    """
    return _norm_launch(x, None, weight, eps, out, None, into)[0]


@overload
def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None, into: None = None,
) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    out: None = None, residual_out: torch.Tensor | None = None, *, into: Fp8Rows,
) -> tuple[Fp8Rows, torch.Tensor]: ...
def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    into: Fp8Rows | None = None,
) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
    """x, residual [..., H] → (RMSNorm(residual + x) * weight, residual + x), both in x's dtype
    (the first quantized into `into`, as rms_norm's, when given)."""
    return _norm_launch(x, residual, weight, eps, out, residual_out, into)


@overload
def silu_mul(
    gate_up: torch.Tensor, out: torch.Tensor | None = None, into: None = None
) -> torch.Tensor: ...
@overload
def silu_mul(gate_up: torch.Tensor, out: None = None, *, into: Fp8Rows) -> Fp8Rows: ...
def silu_mul(
    gate_up: torch.Tensor, out: torch.Tensor | None = None, into: Fp8Rows | None = None
) -> torch.Tensor | Fp8Rows:
    """gate_up [T, 2I] (gate first, then up) → silu(gate) * up [T, I] in gate_up's dtype (with
    `into`, quantized for the next FP8 GEMM instead, as rms_norm's)."""
    t, width = gate_up.shape
    if width % 2:
        raise ValueError(f"silu_mul needs the fused gate|up output (an even width), got {width}")
    inter = width // 2
    gu = _rows(gate_up, "gate_up")
    block = min(_SILU_BLOCK, next_pow2(inter))
    q, s = _quant_target(into, gu, inter, block)
    dst = gu if into is not None else _output(gate_up, (t, inter), out, "out")  # [T, I]
    if t:
        _kernels().silu_mul_kernel[(t, _cdiv(inter, block))](
            gu, dst, q, s,
            gu.stride(0), dst.stride(0), q.stride(0), s.stride(0), s.stride(1),
            INTER=inter,
            BLOCK=block,
            QUANT=into is not None,
            GROUP=fp8_act.GROUP,
            num_warps=4,
        )
    return dst if into is None else into
