"""The single-token GEMV (worker/model/gemv.py) against the torch ops it replaces: F.linear, with
RMSNorm before it, SiLU·mul after it, the residual add after it, bias, float32 logits.

Runs on CUDA; with `TRITON_INTERPRET=1` and triton installed also on CPU tensors in float16
(the interpreter truncates float32 → bfloat16 instead of rounding, which the several roundings
of a fused GEMV turn into ~1% errors). Inputs are strided views with NaN padding after each row
and outputs start NaN-poisoned, so a kernel that reads past a row or skips an element fails.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.worker.test_fused_gpu import (
    DEVICE,
    DTYPES,
    INTERPRET,
    _norm,
    _poisoned,
    _rel,
    _strided,
    kernels,
)
from worker.model import gemv

CASES = [
    (512, 4096),
    (33, 200),
    (130, 2100),
    (64, 96),
    (66, 6000),
    (40, 9000),
]  # (N, K); K > 8192 loops


@pytest.mark.gpu
@kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_reference(dtype: torch.dtype, n: int, k: int, bias: bool) -> None:
    if INTERPRET and dtype == torch.bfloat16:
        pytest.skip("the interpreter truncates to bfloat16 (see the module docstring)")
    gen = torch.Generator().manual_seed(n * 10 + k + bias)
    m, one_block = 1, k <= gemv.MAX_K_ONE_BLOCK
    x = _strided(m, k, dtype, gen)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype).to(DEVICE)
    b = (torch.randn(n, generator=gen)).to(dtype).to(DEVICE) if bias else None
    norm = _norm(k, dtype, gen)
    with torch.no_grad():
        xn = norm(x)  # the torch reference (fused off)
        plain, normed = F.linear(x, w, b), F.linear(xn, w, b)

    out = gemv.gemv(x, w, b, out=_poisoned(m, n, dtype=dtype))
    assert torch.isfinite(out).all() and _rel(out, plain) < 1e-2
    logits = gemv.gemv(x, w, b, out=_poisoned(m, n, dtype=torch.float32))  # lm_head: float32 out
    assert logits.dtype == torch.float32 and _rel(logits, plain) < 1e-2
    assert _rel(gemv.gemv(x, w, b, norm=(norm.weight, norm.eps)), normed) < 1e-2
    if one_block and k > 256:  # the norm's statistics in their own pass over K blocks
        looped = gemv.gemv(x, w, b, norm=(norm.weight, norm.eps), BLOCK_K=256, num_stages=2)
        assert _rel(looped, normed) < 1e-2

    stream = _strided(m, n, dtype, gen, scale=4.0)  # the residual stream, updated in place
    want = stream + plain
    pad = stream.as_strided((m, 7), (stream.stride(0), 1), stream.storage_offset() + n)
    got = gemv.gemv(x, w, b, residual=stream)
    assert got.data_ptr() == stream.data_ptr() and _rel(stream, want) < 1e-2
    assert torch.isnan(pad).all()  # nothing written past the row

    if n % 2 == 0:  # w as gate|up: silu(gate) * up, from the normalized row
        gate, up = normed.chunk(2, dim=-1)
        act = gemv.gemv(
            x,
            w,
            b,
            pair=True,
            norm=(norm.weight, norm.eps),
            out=_poisoned(m, n // 2, dtype=dtype),
        )
        assert torch.isfinite(act).all() and _rel(act, F.silu(gate) * up) < 1e-2


@pytest.mark.gpu
@kernels
def test_gemv_refuses_wrong_shapes_clearly() -> None:
    x, w = torch.zeros(1, 8, device=DEVICE), torch.zeros(6, 8, device=DEVICE)
    with pytest.raises(ValueError, match="x must be one row"):
        gemv.gemv(torch.zeros(2, 8, device=DEVICE), w)
    with pytest.raises(ValueError, match="x must be one row"):
        gemv.gemv(x, torch.zeros(6, 9, device=DEVICE))
    with pytest.raises(ValueError, match="even row count"):
        gemv.gemv(x, torch.zeros(5, 8, device=DEVICE), pair=True)
    with pytest.raises(ValueError, match="norm weight must be"):
        gemv.gemv(x, w, norm=(torch.ones(4, device=DEVICE), 1e-6))
    with pytest.raises(ValueError, match="residual must be"):
        gemv.gemv(x, w, residual=torch.zeros(1, 5, device=DEVICE))
    with pytest.raises(ValueError, match="bias must be"):
        gemv.gemv(x, w, torch.zeros(5, device=DEVICE))
