"""A mixed step's attention, one layer of the 8B shape: prefill rows through one paged-prefill
launch against SDPA per request (worker/model/triton_attention.py, PREFILL_KERNEL_CELLS).

    python3 -m bench.mixed_attention            # GPU

Each case: D decode requests (context C each) and P prefill requests of N new tokens after a
cached prefix of X; times TritonPagedBackend.forward (K/V already stored), host work included,
as a worker's eager attention between piecewise graphs runs it.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from worker.batch import ForwardBatch
from worker.model.triton_attention import PREFILL_KERNEL_CELLS, TritonPagedBackend

HQ, HKV, HEAD, PAGE = 32, 8, 128, 16
# (decodes, their context, prefills, new tokens each, cached before them)
CASES = [(160, 256, 4, 128, 0), (160, 256, 1, 512, 0), (64, 1024, 2, 256, 256),
         (0, 0, 1, 512, 0), (0, 0, 1, 1024, 0), (0, 0, 1, 2048, 0), (0, 0, 4, 512, 1536),
         (0, 0, 1, 8192, 0)]


def make_batch(case: tuple[int, int, int, int, int]) -> tuple[ForwardBatch, torch.Tensor,
                                                              torch.Tensor, torch.Tensor]:
    decodes, ctx, prefills, new, cached = case
    reqs = [(ctx, 1)] * decodes + [(cached + new, new)] * prefills
    pages_of = [-(-total // PAGE) for total, _ in reqs]
    cache = torch.randn(sum(pages_of) + 1, 2, HKV, PAGE, HEAD, device="cuda",
                        dtype=torch.bfloat16)
    k_cache, v_cache = cache[:, 0], cache[:, 1]
    width, first, tables, qs = max(pages_of), 1, [], [0]
    for n in pages_of:
        tables.append(list(range(first, first + n)) + [0] * (width - n))
        first += n
    for _, new_tokens in reqs:
        qs.append(qs[-1] + new_tokens)
    lens = [total for total, _ in reqs]
    t = qs[-1]
    dev = torch.device("cuda")
    batch = ForwardBatch(
        input_ids=torch.zeros(t, dtype=torch.int64, device=dev),
        positions=torch.zeros(t, dtype=torch.int64, device=dev),
        query_start=torch.tensor(qs, device=dev), seq_lens=torch.tensor(lens, device=dev),
        page_table=torch.tensor(tables, device=dev),
        slot_mapping=torch.full((t,), -1, dtype=torch.int64, device=dev),
        logits_indices=torch.tensor(qs[1:], device=dev) - 1, query_start_list=qs,
        seq_lens_list=lens)
    q = torch.randn(t, HQ, HEAD, device=dev, dtype=torch.bfloat16)
    return batch, q, k_cache, v_cache


def time_us(backend: TritonPagedBackend, batch: ForwardBatch, q: torch.Tensor, kc: torch.Tensor,
            vc: torch.Tensor, iters: int = 30) -> float:
    empty = q.new_empty(0, HKV, HEAD)

    def once() -> None:  # a new batch object each call: its plan too, as one step's layer pays
        backend.forward(q, empty, empty, kc, vc, replace(batch), HEAD**-0.5, kv_stored=True)

    for _ in range(3):
        once()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        once()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


def main() -> None:
    print(f"one layer, {HQ} q heads / {HKV} kv heads x {HEAD}, bf16 pages of {PAGE}; "
          f"PREFILL_KERNEL_CELLS = {PREFILL_KERNEL_CELLS:,}")
    print("| decodes x context | prefills x new (+cached) | cells each | kernel µs | SDPA µs | "
          "kernel / SDPA | default takes |")
    print("|---|---|---|---|---|---|---|")
    for case in CASES:
        batch, q, kc, vc = make_batch(case)
        kernel = time_us(TritonPagedBackend(prefill_kernel_cells=1 << 62), batch, q, kc, vc)
        sdpa = time_us(TritonPagedBackend(prefill_kernel_cells=0), batch, q, kc, vc)
        decodes, ctx, prefills, new, cached = case
        cells = new * (cached + new)  # the largest request's (all are alike)
        print(f"| {decodes} x {ctx} | {prefills} x {new} (+{cached}) | {cells:,} | "
              f"{kernel:,.0f} | {sdpa:,.0f} | {kernel / sdpa:.2f} | "
              f"{'kernel' if cells <= PREFILL_KERNEL_CELLS else 'SDPA'} |", flush=True)


if __name__ == "__main__":
    main()
