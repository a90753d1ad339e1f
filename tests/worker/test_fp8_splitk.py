"""The split-K FP8 GEMM (worker/model/fp8_splitk.py) against its dequantized reference.

On CUDA every path runs: activations quantized in the kernel (bf16 x, the norm folded in for
one token), SwiGLU pairs, the residual add, bias, partial sums over 1 to 8 splits, CUDA-graph
replays (the tile counters reset themselves), and `fp8_linear`'s dispatch. Without a GPU the
kernel runs under Triton's interpreter in a subprocess (CI has no GPU) on pre-quantized
activations: the interpreter rounds float32 → e4m3 wrongly (tests/worker/test_fp8_gpu.py), so
the in-kernel quantization is checked on CUDA only.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.worker.test_fused_gpu import HAS_TRITON, _rel, gpu
from worker.model import fp8
from worker.model.fp8 import BlockFp8Config
from worker.model.fp8_gemm import quantize_activations
from worker.model.fp8_splitk import SplitCounters, fp8_splitk

REPO = Path(__file__).resolve().parents[2]
BLOCK = BlockFp8Config()
# m, n (output features; a pair's half), k, split, pair, residual, bias: ragged N and K, one
# split and several, 1 to 64 tokens
CASES = [
    (1, 256, 512, 4, True, False, True),
    (3, 256, 512, 2, False, False, False),
    (5, 200, 300, 1, False, True, False),
    (17, 256, 640, 2, True, True, True),
    (64, 384, 1024, 8, False, True, True),
]


def _reference(
    x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, bias: torch.Tensor | None, pair: bool,
    stream: torch.Tensor | None, quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The torch path on the kernel's operands: x (or its quantized (xq, xs)) times w·ws,
    rounded to x's dtype, then the bias, SwiGLU and the residual add, each rounded."""
    m, k = x.shape
    x_deq = x.float()
    if quantized is not None:
        x_deq = quantized[0].float() * quantized[1].repeat_interleave(128, 1)[:, :k]
    y = F.linear(x_deq, fp8.dequantize_weight(w, ws, (128, 128))).to(x.dtype)
    if bias is not None:
        y = y + bias
    if pair:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y if stream is None else stream + y


MODES = ["f16", "e4m3", "e4m3_prequantized"]  # weights widened / x quantized in or before


def _case(case: tuple, device: str, mode: str) -> tuple[float, list[int]]:
    """Runs one case in one mode (twice: the second call finds the counters reset), returns the
    relative error against the reference and the counters after."""
    m, n, k, split, pair, residual, has_bias = case
    g = torch.Generator().manual_seed(m * n + k)
    dtype = torch.float16 if device == "cpu" else torch.bfloat16  # the interpreter: no bf16
    rows = 2 * n if pair else n
    w, ws = fp8.quantize_blockwise(torch.randn(rows, k, generator=g) * k**-0.5)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(rows, generator=g).to(dtype) if has_bias else None
    stream = torch.randn(m, n, generator=g).to(dtype) if residual else None
    prequantized = mode == "e4m3_prequantized"
    xq, xs = quantize_activations(x, 128)  # torch's quantizer: the reference's operands
    want = _reference(x, w, ws, bias, pair, stream, None if mode == "f16" else (xq, xs))
    counters = SplitCounters()
    dev = [t if t is None else t.to(device) for t in (x, w, ws, bias, xq, xs)]
    for _ in range(2):
        out = fp8_splitk(
            dev[4] if prequantized else dev[0], dev[1], dev[2], BLOCK, counters, dev[3],
            x_scale=dev[5] if prequantized else None, pair=pair,
            residual=None if stream is None else stream.to(device, copy=True), out_dtype=dtype,
            BN=64, SPLIT=split, F16=mode == "f16",
        )
    assert counters.counts is not None
    return _rel(out.cpu().float(), want.float()), counters.counts.cpu().tolist()


_INTERPRETED = """
import sys
from tests.worker.test_fp8_splitk import CASES, _case
for case in CASES:
    for mode in ("f16", "e4m3_prequantized"):
        err, counts = _case(case, "cpu", mode)
        print(case, mode, err, counts)
        assert err < 2e-3 and not any(counts), (case, mode, err, counts)
"""


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_splitk_under_the_interpreter_sums_its_splits_and_resets_its_counters() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", _INTERPRETED], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode", MODES)
def test_splitk_matches_its_reference_on_cuda(case: tuple, mode: str) -> None:
    err, counts = _case(case, "cuda", mode)
    # in-kernel quantization: the same division and rounding as the torch quantizer, up to a
    # last-place tie; float16 operands: x·scale rounded to float16; the sums in another order
    assert err < (1e-2 if mode != "e4m3_prequantized" else 2e-3) and not any(counts)


@pytest.mark.gpu
@gpu
def test_one_token_with_the_norm_folded_in() -> None:
    from worker.model.layers import RMSNorm

    g = torch.Generator().manual_seed(3)
    k, n = 4096, 256
    w, ws = fp8.quantize_blockwise(torch.randn(2 * n, k, generator=g) * k**-0.5)
    norm = RMSNorm(k, 1e-6, torch.bfloat16)
    norm.weight.data = torch.rand(k, generator=g).to(torch.bfloat16) + 0.5
    x = torch.randn(1, k, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        xn = norm(x)
    want = _reference(xn, w, ws, None, True, None)
    out = fp8_splitk(x.cuda(), w.cuda(), ws.cuda(), BLOCK, SplitCounters(), pair=True,
                     norm=(norm.weight.cuda(), 1e-6))
    assert _rel(out.cpu().float(), want.float()) < 1e-2


@pytest.mark.gpu
@gpu
def test_graph_replays_and_fp8_linear_dispatch() -> None:
    """A CUDA graph of the GEMM replays right (each replay's last program resets its tile's
    counter), and fp8_linear takes it for 1-64 tokens when the linear hands its counters."""
    from worker.model.fp8_gemm import fp8_linear

    g = torch.Generator().manual_seed(4)
    n, k = 512, 4096
    w, ws = (t.cuda() for t in fp8.quantize_blockwise(torch.randn(n, k, generator=g) * 0.02))
    x = torch.randn(8, k, generator=g).to(torch.bfloat16).cuda()
    counters = SplitCounters()
    want = fp8_linear(x, w, ws, None, BLOCK)  # cuBLAS or the Triton GEMM: no counters
    got = fp8_linear(x, w, ws, None, BLOCK, counters)
    assert counters.counts is not None and _rel(got.float(), want.float()) < 1e-2
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear(static, w, ws, None, BLOCK, counters)
    for seed in range(3):
        static.copy_(torch.randn(8, k, generator=torch.Generator().manual_seed(seed)).cuda())
        graph.replay()
        ref = fp8_linear(static, w, ws, None, BLOCK)
        assert _rel(out.float(), ref.float()) < 1e-2
    assert not counters.counts.any()
