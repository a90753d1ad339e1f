"""The engine as it was before each of issue 20's changes, for the baselines bench/fp8.py
measures in the same process: each is a patch under which an engine built captures its CUDA
graphs the old way (the patched names are read at launch time, and a graph keeps what its
capture launched)."""

from __future__ import annotations

from contextlib import AbstractContextManager as ContextManager
from typing import Any
from unittest import mock


def without_splitk() -> ContextManager[Any]:
    """The dispatch before the split-K GEMM (worker/model/fp8_splitk.py), for the baseline rows
    of the same process: 1-32 tokens through cuBLAS's blockwise _scaled_mm (or the Triton GEMM).
    Engines built inside capture their graphs this way."""
    from worker.model import fp8_splitk

    return mock.patch.object(fp8_splitk, "fits", lambda *a: False)


def without_quantized_splitk() -> ContextManager[Any]:
    """The dispatch before the split-K GEMM took 33-64 tokens over quantized x: those steps go
    through cuBLAS's blockwise _scaled_mm (fed by the same fused quantization). Engines built
    inside capture their graphs this way."""
    from worker.model import fp8_splitk

    fits = fp8_splitk.fits
    return mock.patch.object(fp8_splitk, "fits", lambda m, dtype, quant: (
        m <= fp8_splitk.WIDENED_TOKENS and fits(m, dtype, quant)))


def with_split_fp8_batches() -> ContextManager[Any]:
    """The decode kernel's rule before large batches over e4m3 pages ran unsplit: every batch
    split by DECODE_SPLITS in 128-token blocks. Engines built inside capture their graphs this
    way."""
    from worker.model import triton_decode

    return mock.patch.object(triton_decode, "FP8_UNSPLIT_PROGRAMS", 1 << 30)


def without_fused_quant() -> ContextManager[Any]:
    """The dispatch before the fused activation quantization (worker/model/fp8_act.py): every
    cuBLAS step quantizes its input in its own kernel. Engines built inside capture their
    graphs this way."""
    from worker.model import fp8_gemm

    return mock.patch.object(fp8_gemm, "input_rows", lambda *a, **k: None)


def without_decode_maxnreg() -> ContextManager[Any]:
    """The decode kernel over e4m3 pages at the registers Triton gives it (130: three programs
    an SM), as before its 128-register cap (worker/model/triton_decode.py). Engines built
    inside capture their graphs this way."""
    from worker.model import triton_decode

    configs = dict(triton_decode.DECODE_CONFIGS)
    configs[True] = {k: v for k, v in configs[True].items() if k != "maxnreg"}
    return mock.patch.object(triton_decode, "DECODE_CONFIGS", configs)


def without_few_token_tiles() -> ContextManager[Any]:
    """The fused q/k norm, RoPE and store with 8 heads a program at every step size, as before
    (worker/model/fused_rope.py). Engines built inside capture their graphs this way."""
    from worker.model import fused_rope

    return mock.patch.object(fused_rope, "FEW_TOKENS", 0)
