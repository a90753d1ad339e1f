"""The split-K FP8 GEMM (worker/model/fp8_splitk.py) against its dequantized reference, x as it
is and x quantized 1×128 (Fp8Rows): ragged N and K, bias, 1 to 8 splits, the tile counters back
at zero after every call, CUDA-graph replays, and `fp8_linear`'s dispatch. Without a GPU the
kernel runs under Triton's interpreter in a subprocess (CI has no GPU; float16 there, the
interpreter has no bfloat16 rounding; x is quantized by torch there, fp8_act.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.worker.interpreter import run_interpreted
from tests.worker.test_fused_gpu import HAS_TRITON, _rel, gpu
from worker.arch.fp8_config import BlockFp8Config
from worker.model import fp8
from worker.model.fp8_act import PAD_ROWS, Fp8Rows, quantize_activations
from worker.model.fp8_gemm import Route, route
from worker.model.fp8_splitk import MAX_TOKENS, WIDENED_TOKENS, SplitCounters, fits, fp8_splitk

BLOCK = BlockFp8Config()
CASES = [  # m, n, k, split, bias, x quantized
    (1, 256, 512, 4, True, False),
    (3, 256, 512, 2, False, False),
    (5, 200, 300, 1, False, False),  # N and K not whole blocks
    (16, 384, 1024, 8, True, False),
    (40, 128, 512, 2, False, False),  # x as it is past 32 tokens: the bench's 64 tokens
    (9, 192, 640, 3, True, False),  # 5 K blocks over 3 splits: the last one short
    (48, 256, 1024, 4, True, True),  # the engine's 33-64 tokens
    (64, 200, 300, 2, False, True),  # N and K not whole blocks
    (3, 192, 640, 3, False, True),  # 5 K blocks over 3 splits
]


def _case(case: tuple, device: str) -> tuple[float, list[int]]:
    """Runs one case twice (the second call finds the counters reset); returns the relative
    error against F.linear over the dequantized weight (and dequantized x, when quantized) and
    the counters after."""
    m, n, k, split, has_bias, quantized = case
    g = torch.Generator().manual_seed(m * n + k)
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    w, ws = fp8.quantize_blockwise(torch.randn(n, k, generator=g) * k**-0.5)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype) if has_bias else None
    x_in: torch.Tensor | Fp8Rows = x.to(device)
    x_ref = x.float()
    if quantized:
        xq, xs = quantize_activations(x.float(), 128, pad_rows=PAD_ROWS, m_major=True)
        x_in = Fp8Rows(xq.to(device), xs.to(device), m, dtype)
        x_ref = fp8.dequantize_weight(xq[:m], xs[:m].contiguous(), (1, 128))
    want = F.linear(x_ref, fp8.dequantize_weight(w, ws, (128, 128))).to(dtype)
    if bias is not None:
        want = want + bias
    counters = SplitCounters()
    for _ in range(2):
        out = fp8_splitk(x_in, w.to(device), ws.to(device), BLOCK, counters,
                         None if bias is None else bias.to(device), BN=64, SPLIT=split)
    assert counters.counts is not None and out.dtype == dtype
    return _rel(out.cpu().float(), want.float()), counters.counts.cpu().tolist()


_INTERPRETED = """
from tests.worker.test_fp8_splitk import CASES, _case
for case in CASES:
    err, counts = _case(case, "cpu")
    print(case, err, counts)
    assert err < 2e-3 and not any(counts), (case, err, counts)
"""


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_splitk_under_the_interpreter_sums_its_splits_and_resets_its_counters() -> None:
    run_interpreted(_INTERPRETED)


def test_takes_small_bf16_batches_on_cuda_only() -> None:
    assert fits(4, torch.bfloat16, BLOCK) and fits(MAX_TOKENS, torch.float16, BLOCK)
    assert not fits(4, torch.float32, BLOCK) and not fits(MAX_TOKENS + 1, torch.bfloat16, BLOCK)
    assert not fits(0, torch.bfloat16, BLOCK)
    narrow_k = BlockFp8Config(block_k=64)  # x's groups are 128 wide: quantized steps refused
    assert fits(WIDENED_TOKENS, torch.bfloat16, narrow_k)
    assert not fits(WIDENED_TOKENS + 1, torch.bfloat16, narrow_k)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # route() only reads the device type
    assert route(4, 256, 128, torch.bfloat16, cpu, BLOCK, True) is Route.REFERENCE
    assert route(4, 256, 128, torch.bfloat16, cuda, BLOCK, True) is Route.SPLITK
    assert route(WIDENED_TOKENS, 256, 128, torch.bfloat16, cuda, BLOCK, True) is Route.SPLITK
    assert route(WIDENED_TOKENS + 1, 256, 128, torch.bfloat16, cuda, BLOCK,
                 True) is Route.SPLITK_QUANTIZED
    assert route(MAX_TOKENS, 256, 128, torch.bfloat16, cuda, BLOCK,
                 True) is Route.SPLITK_QUANTIZED
    assert route(4, 256, 128, torch.float32, cuda, BLOCK, True) is not Route.SPLITK
    assert route(4, 256, 128, torch.bfloat16, cuda, BLOCK, False) is not Route.SPLITK
    with pytest.raises(ValueError, match="M ≤ 64"):
        fp8_splitk(torch.zeros(MAX_TOKENS + 1, 256), torch.zeros(128, 256, dtype=fp8.FP8),
                   torch.ones(1, 2), BLOCK, SplitCounters())


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", CASES)
def test_splitk_matches_its_reference_on_cuda(case: tuple) -> None:
    err, counts = _case(case, "cuda")
    # widened: x·scale rounded to float16; both: sums in another order, bf16 output
    assert err < 1e-2 and not any(counts)


@pytest.mark.gpu
@gpu
def test_graph_replays_and_fp8_linear_dispatch() -> None:
    """A CUDA graph of the GEMM replays right (each replay's last program resets its tile's
    counter), and fp8_linear takes it for 1-32 tokens when the linear hands its counters."""
    from worker.model.fp8_gemm import fp8_linear

    g = torch.Generator().manual_seed(4)
    n, k = 512, 4096
    w, ws = fp8.quantize_blockwise(torch.randn(n, k, generator=g) * 0.02)
    w_ref = fp8.dequantize_weight(w, ws, (128, 128))
    w, ws = w.cuda(), ws.cuda()
    counters = SplitCounters()
    static = torch.zeros(8, k, dtype=torch.bfloat16, device="cuda")
    fp8_linear(static, w, ws, None, BLOCK, counters)  # warm-up: the counters are made here
    assert counters.counts is not None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear(static, w, ws, None, BLOCK, counters)
    for seed in range(3):
        x = torch.randn(8, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        static.copy_(x.cuda())
        graph.replay()
        ref = F.linear(x.float(), w_ref).to(torch.bfloat16)
        assert _rel(out.cpu().float(), ref.float()) < 1e-2
    assert not counters.counts.any()
