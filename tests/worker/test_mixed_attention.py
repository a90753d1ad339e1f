"""A mixed step's attention on the GPU backend: its prefill rows through one paged-prefill launch
(short prompts and chunks), or through SDPA per request (long ones), against the torch reference.

The cases run on CUDA, and in CI under Triton's interpreter in a subprocess (CPU tensors). The
caches are the strided views of a real `KVCache` with page 0 (padding) full of NaN
(tests/worker/test_gpt_oss_kernels.py `_batch`), so a read of a wrong page or row fails.
"""

from __future__ import annotations

import pytest
import torch

from tests.worker.interpreter import run_interpreted
from tests.worker.test_gpt_oss_kernels import DEVICE, HAS_GPU, HAS_TRITON, HKV, D, _batch
from worker.model import fp8
from worker.model.attention import TorchSDPABackend

# (cached tokens, new tokens) per request: decodes, fresh prompts, a chunk after a cached prefix
# longer than a program's 32 rows, a one-token prompt
MIXED = [(12, 1), (0, 7), (30, 1), (9, 40), (0, 1), (5, 3), (0, 70), (47, 1)]
# (sliding window, FP8 pages, sinks, V token-major as a KVCache keeps FP8 pages)
CASES = [(None, False, False, False), (6, False, False, False), (None, True, False, True),
         (6, True, False, True), (6, True, True, True), (6, True, False, False)]


def tolerance(fp8_pages: bool) -> float:
    """The decode rows' error (the prefill kernel's float32 dots are exact: "ieee"). Under the
    interpreter float32 pages are exact but for the order of sums, and FP8 pages' dots run in
    float16 by design (worker/model/triton_attention.py), ~3e-4 here. On a GPU the decode
    kernel's float32 dots run as TF32: ~2e-3 here."""
    if torch.cuda.is_available():
        return 5e-3
    return 2e-3 if fp8_pages else 1e-4


def _case(window: int | None, fp8_pages: bool, with_sinks: bool = False,
          token_major: bool = False) -> float:
    """The largest error of either path against the reference; asserts which path ran. With
    sinks (GPT-OSS) the whole step takes the prefill kernel, whatever its size."""
    from worker.model.triton_attention import TritonPagedBackend

    batch, kv, q, sinks = _batch(MIXED, seed=7)
    sinks = sinks if with_sinks else None
    k_cache, v_cache = kv.layer(0)
    scales = None
    if fp8_pages:  # the same values stored as e4m3 with a scale per kv head
        gen = torch.Generator().manual_seed(8)
        scales = tuple((torch.rand(HKV, generator=gen) / 40 + 0.01).to(DEVICE) for _ in range(2))
        k_cache, v_cache = (
            fp8.quantize_kv(c.transpose(1, 2).reshape(-1, HKV, D), s)
            .reshape(c.shape[0], c.shape[2], HKV, D).transpose(1, 2)
            for c, s in zip((k_cache, v_cache), scales, strict=True))
        if token_major:  # [P, Hkv, D, S] in memory, viewed as [P, Hkv, S, D]
            v_cache = v_cache.transpose(2, 3).contiguous().transpose(2, 3)
    empty = q.new_empty(0, HKV, D)
    want = TorchSDPABackend().forward(q, empty, empty, k_cache, v_cache, batch, D**-0.5, window,
                                      kv_stored=True, sinks=sinks, kv_scales=scales)
    err = 0.0
    for cells, kernel in ((1 << 20, True), (0, False)):
        backend = TritonPagedBackend(prefill_kernel_cells=cells)
        got = backend.forward(q, empty, empty, k_cache, v_cache, batch, D**-0.5, window,
                              kv_stored=True, sinks=sinks, kv_scales=scales)
        if sinks is None:
            assert backend._plan is not None and backend._plan.prefill_kernel is kernel
        err = max(err, float((got.float() - want.float()).abs().max()))
    return err


_INTERPRETED = """
from tests.worker.test_mixed_attention import CASES, _case, tolerance
for case in CASES:
    err = _case(*case)
    print(case, err)
    assert err < tolerance(case[1]), (case, err)
"""


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_mixed_step_under_the_interpreter_equals_the_reference() -> None:
    run_interpreted(_INTERPRETED)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs CUDA and triton")
@pytest.mark.parametrize(("window", "fp8_pages", "sinks", "token_major"), CASES)
def test_mixed_step_on_the_gpu_equals_the_reference(window: int | None, fp8_pages: bool,
                                                    sinks: bool, token_major: bool) -> None:
    assert _case(window, fp8_pages, sinks, token_major) < tolerance(fp8_pages)


def test_the_kernel_takes_steps_whose_every_request_is_short() -> None:
    from worker.model.triton_attention import PREFILL_KERNEL_CELLS, TritonPagedBackend

    assert PREFILL_KERNEL_CELLS == 1024 * 1024
    for lens, kernel in (([(0, 1), (0, 1024), (0, 1024)], True),  # many short: one launch
                         ([(0, 1), (48, 1001)], False)):  # one long prompt: FlashAttention
        batch = _batch(lens, seed=9)[0]
        assert TritonPagedBackend()._split(batch).prefill_kernel is kernel, lens
