"""FP8 activations written by the kernel that produces them (worker/model/fp8_act.py, fused.py
`into=`): the fused norm and SiLU·mul quantize their output exactly as the quantizer would
quantize their unquantized output, and a step's FP8 linear takes those rows as cuBLAS input.

The kernel tests run on CUDA, and with `TRITON_INTERPRET=1` on CPU tensors, where the reference
is the quantizer's own Triton kernel (the interpreter rounds float32 → e4m3 wrongly, the same
wrong way in both). Rows past M in the padded buffers are never read back and are not checked.
"""

from __future__ import annotations

import pytest
import torch

from tests.worker.test_fused_gpu import DEVICE, DTYPES, INTERPRET, _norm, _strided, gpu, kernels
from worker.arch.fp8_config import BlockFp8Config
from worker.model import fp8_act, fused
from worker.model.fp8_act import Fp8Rows


def _quantized(y: torch.Tensor) -> Fp8Rows:
    """y [M, K] through the standalone quantizer's kernel: the reference."""
    m, k = y.shape
    rows = Fp8Rows.empty(m, k, y.dtype, y.device)
    groups = rows.scales.shape[1]
    fp8_act.jit().act_quant_kernel[(m,)](
        y, rows.q, rows.scales, y.stride(0), rows.q.stride(0), rows.scales.stride(0),
        rows.scales.stride(1), k, GROUP=fp8_act.GROUP, GROUPS=1 << (groups - 1).bit_length(),
    )
    return rows


def _same(got: Fp8Rows, want: Fp8Rows) -> None:
    m = want.rows
    assert got.rows == m and got.dtype == want.dtype
    assert torch.equal(got.scales[:m].cpu(), want.scales[:m].cpu())
    assert torch.equal(got.q[:m].view(torch.uint8).cpu(), want.q[:m].view(torch.uint8).cpu())


@pytest.mark.gpu
@kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_and_silu_mul_write_the_quantizers_bytes(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    m, hidden, inter = 37, 1024, 1536  # silu_mul: 2 blocks a row, the second 4 groups short
    norm = _norm(hidden, dtype, gen)
    x = _strided(m, hidden, dtype, gen)
    residual = _strided(m, hidden, dtype, gen, scale=3.0)
    rows = fused.rms_norm(x, norm.weight, norm.eps, into=Fp8Rows.empty(m, hidden, dtype,
                                                                        x.device))
    _same(rows, _quantized(fused.rms_norm(x, norm.weight, norm.eps)))

    want, want_res = fused.add_rms_norm(x, residual, norm.weight, norm.eps)
    rows, res = fused.add_rms_norm(x, residual, norm.weight, norm.eps,
                                   into=Fp8Rows.empty(m, hidden, dtype, x.device))
    assert torch.equal(res, want_res)  # the new residual is written as before
    _same(rows, _quantized(want))

    gate_up = _strided(m, 2 * inter, dtype, gen, scale=2.0)
    rows = fused.silu_mul(gate_up, into=Fp8Rows.empty(m, inter, dtype, x.device))
    _same(rows, _quantized(fused.silu_mul(gate_up)))


@pytest.mark.gpu
@kernels
def test_into_of_the_wrong_shape_is_refused() -> None:
    x = torch.zeros(4, 512, dtype=torch.float16, device=DEVICE)
    w = torch.ones(512, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="into must be Fp8Rows.empty\\(4, 512"):
        fused.rms_norm(x, w, 1e-6, into=Fp8Rows.empty(4, 256, torch.float16, x.device))
    with pytest.raises(ValueError, match="into must be"):
        fused.silu_mul(torch.zeros(3, 1024, dtype=torch.float16, device=DEVICE),
                       into=Fp8Rows.empty(4, 512, torch.float16, x.device))


@pytest.mark.gpu
@gpu
def test_a_linear_takes_its_input_from_the_norm_on_the_quantized_routes_only() -> None:
    from worker.model import fp8_gemm
    from worker.model.layers import ColumnParallelLinear, TPInfo

    quant = BlockFp8Config()
    gen = torch.Generator().manual_seed(3)
    hidden, n = 1024, 384
    linear = ColumnParallelLinear(hidden, [n], False, TPInfo(), torch.bfloat16, quant).to(DEVICE)
    with torch.no_grad():
        linear.weight.copy_((torch.randn(n, hidden, generator=gen) * 50).to(torch.float8_e4m3fn))
        linear.weight_scale_inv.copy_(torch.rand(linear.weight_scale_inv.shape, generator=gen))
    norm = _norm(hidden, torch.bfloat16, gen)
    norm.fused = True
    for m in (1, 32):  # the split-K GEMM's widened steps read x unquantized: no rows for them
        assert linear.input_rows(m, torch.bfloat16, torch.device(DEVICE)) is None
    # 48 tokens: the split-K GEMM over quantized x; 96: cuBLAS (where it has the recipe)
    sizes = [48] + ([96] if fp8_gemm.cublas_blockwise(torch.device(DEVICE)) else [])
    for m in sizes:
        x = _strided(m, hidden, torch.bfloat16, gen)
        residual = _strided(m, hidden, torch.bfloat16, gen)
        rows, res = norm.norm_for(linear, x, residual)
        assert isinstance(rows, Fp8Rows) and rows.rows == m
        h, want_res = norm.add_norm(x, residual)
        assert torch.equal(res, want_res)
        assert torch.equal(linear(rows), linear(h))  # the same operands, bit for bit
    assert not INTERPRET
