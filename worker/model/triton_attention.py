"""GPU attention over the page-major KV pool: `TritonPagedBackend` behind `AttentionBackend`
(worker/model/attention.py).

- store and decode (every request has one new token): the Triton kernels of
  worker/model/triton_decode.py (split-K paged decode, FP8 pages, sinks).
- prefill / mixed steps: the one-token requests go through the decode kernel. The multi-token
  requests, while they are short (none with more than PREFILL_KERNEL_CELLS new-token x context
  pairs: a mixed step's prompts and chunks), go through one launch of the paged prefill kernel of
  worker/model/triton_prefill.py, which reads the pages in place; longer ones each gather their
  context into contiguous K/V and call torch SDPA (FlashAttention when nothing is cached before
  the chunk, lower-right causal otherwise).
- attention sinks (GPT-OSS): a mixed step with sinks runs the paged prefill kernel over the
  whole batch (SDPA has no sink term).
- FP8 KV pages (`kv_scales` given): the kernels read them as triton_decode.py says; the prefill
  kernel does the same per block; SDPA's gather dequantizes (scale applied in float32, then q's
  dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.batch import ForwardBatch, MixedRows
from worker.model.attention import AttentionBackend, KVScales, sdpa_prefill
from worker.model.triton_decode import triton_paged_decode, triton_store_kv
from worker.model.triton_prefill import triton_paged_prefill

# A step's prefill rows take the paged-prefill kernel while no request of them has more (new
# token, context token) pairs than this; else SDPA per request. bench/mixed_attention.py (H200,
# one 8B layer): the kernel takes 0.22-0.79x SDPA's time up to 1024 x 1024, 0.50x for four
# 512-token chunks after 1,536 cached; 1.19x for one 2,048-token prompt, 5.3x for 8,192.
PREFILL_KERNEL_CELLS = 1 << 20


@dataclass
class _KernelRows:
    """A step's prefill requests as one paged-prefill launch takes them."""

    start: torch.Tensor  # [Bp] first row in q
    end: torch.Tensor  # [Bp] one past the last row
    page_table: torch.Tensor  # [Bp, max_pages]
    seq_lens: torch.Tensor  # [Bp]
    longest: int  # the most new tokens of one of them


@dataclass
class _MixedPlan:
    """How a mixed step's rows split (computed once per batch, shared by its layers)."""

    token_index: torch.Tensor  # [Bd] int64: the one-token requests' rows in q
    page_table: torch.Tensor  # [Bd, max_pages]
    seq_lens: torch.Tensor  # [Bd]
    prefills: list[int]  # indices of the multi-token requests
    kernel_rows: _KernelRows | None  # set: they take one launch; None: SDPA each (if any)

    @property
    def prefill_kernel(self) -> bool:
        return self.kernel_rows is not None


class TritonPagedBackend(AttentionBackend):
    """CUDA backend: Triton store + split-K paged decode; multi-token requests of a step through
    one Triton paged-prefill launch while they are short, else SDPA each.

    `prefill_kernel_cells`: the step takes the kernel while none of its prefill requests has
    more new tokens x context than this. Short prompts and chunks beside a running batch (what
    a mixed step carries) pay ~5 launches and a context gather each per layer through SDPA; a
    long prompt's attention is worth FlashAttention's speed.
    """

    def __init__(self, prefill_kernel_cells: int = PREFILL_KERNEL_CELLS) -> None:
        self.prefill_kernel_cells = prefill_kernel_cells
        self._batch: ForwardBatch | None = None
        self._plan: _MixedPlan | None = None

    def _split(self, batch: ForwardBatch) -> _MixedPlan:
        if self._batch is batch:  # one plan per forward pass; layers share it
            assert self._plan is not None
            return self._plan
        qs, lens, dev = batch.query_start_list, batch.seq_lens_list, batch.seq_lens.device
        dec = [i for i in range(batch.num_requests) if qs[i + 1] - qs[i] == 1]
        pre = [i for i in range(batch.num_requests) if qs[i + 1] - qs[i] > 1]
        cells = max(((qs[i + 1] - qs[i]) * lens[i] for i in pre), default=0)

        def rows(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(dev, non_blocking=True)

        kernel_rows = None
        if pre and cells <= self.prefill_kernel_cells:
            pidx = rows(pre)
            kernel_rows = _KernelRows(
                start=rows([qs[i] for i in pre]), end=rows([qs[i + 1] for i in pre]),
                page_table=batch.page_table.index_select(0, pidx),
                seq_lens=batch.seq_lens.index_select(0, pidx),
                longest=max(qs[i + 1] - qs[i] for i in pre))
        idx = rows(dec)
        plan = _MixedPlan(
            token_index=rows([qs[i] for i in dec]),
            page_table=batch.page_table.index_select(0, idx),
            seq_lens=batch.seq_lens.index_select(0, idx), prefills=pre, kernel_rows=kernel_rows)
        self._batch, self._plan = batch, plan
        return plan

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
        v_cache: torch.Tensor, batch: ForwardBatch, scale: float, sliding_window: int | None = None,
        kv_stored: bool = False, sinks: torch.Tensor | None = None, kv_scales: KVScales = None,
    ) -> torch.Tensor:
        if not kv_stored:
            triton_store_kv(k, v, k_cache, v_cache, batch.slot_mapping, kv_scales)
        # pure decode: the CUDA-graph path, no host reads
        if batch.num_tokens == batch.num_requests:
            return triton_paged_decode(
                q, k_cache, v_cache, batch.page_table, batch.seq_lens, scale, sliding_window,
                sinks=sinks, kv_scales=kv_scales,
            )
        if batch.uniform_query_len and kv_scales is None:
            # A captured verify step (k + 1 tokens per request): device tensors only, one launch.
            return triton_paged_prefill(
                q, k_cache, v_cache, batch.page_table, batch.query_start, batch.seq_lens,
                batch.uniform_query_len, scale, sliding_window, sinks,
            )
        if sinks is not None:  # SDPA has no sink term: one paged prefill kernel over the whole step
            qs = batch.query_start_list
            longest = max(qs[i + 1] - qs[i] for i in range(batch.num_requests))
            return triton_paged_prefill(
                q, k_cache, v_cache, batch.page_table, batch.query_start, batch.seq_lens, longest,
                scale, sliding_window, sinks, kv_scales,
            )
        if batch.mixed_rows is not None:  # a captured mixed step (worker/mixed_graphs.py)
            return mixed_rows_attention(q, k_cache, v_cache, batch.mixed_rows, scale,
                                        sliding_window, kv_scales)
        plan = self._split(batch)
        out = torch.empty_like(q)  # [T, Hq, D]
        if plan.token_index.numel():
            out[plan.token_index] = triton_paged_decode(
                q.index_select(0, plan.token_index), k_cache, v_cache, plan.page_table,
                plan.seq_lens, scale, sliding_window, kv_scales=kv_scales,
            )
        if (rows := plan.kernel_rows) is not None:
            return triton_paged_prefill(
                q, k_cache, v_cache, rows.page_table, rows.start, rows.seq_lens, rows.longest,
                scale, sliding_window, None, kv_scales, query_end=rows.end, out=out,
            )
        page_size = k_cache.shape[2]
        qs, lens = batch.query_start_list, batch.seq_lens_list
        for i in plan.prefills:
            pages = batch.page_table[i, : -(-lens[i] // page_size)]
            out[qs[i] : qs[i + 1]] = sdpa_prefill(
                q[qs[i] : qs[i + 1]], k_cache, v_cache, pages, lens[i], scale, sliding_window,
                kv_scales,
            )
        return out


def mixed_rows_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: MixedRows,
    scale: float, sliding_window: int | None, kv_scales: KVScales,
) -> torch.Tensor:
    """A mixed step's attention from device tensors of fixed shape only (capturable): q [T, Hq,
    D] → [T, Hq, D]. The one-token rows through the decode kernel (padding rows: context 0,
    zeros, scattered into a spare row T), then every multi-token request through one
    paged-prefill launch over the whole T (padding requests have no rows). Rows of neither
    (the bucket's padding tokens) are left unwritten."""
    t = q.shape[0]
    out = q.new_empty(t + 1, *q.shape[1:])  # [T+1, Hq, D]: row T takes the padding decode rows
    decoded = triton_paged_decode(q.index_select(0, rows.decode_q_rows), k_cache, v_cache,
                                  rows.decode_page_table, rows.decode_seq_lens, scale,
                                  sliding_window, kv_scales=kv_scales)  # [D, Hq, D]
    out.index_copy_(0, rows.decode_out_rows, decoded)
    triton_paged_prefill(q, k_cache, v_cache, rows.prefill_page_table, rows.prefill_start,
                         rows.prefill_seq_lens, t, scale, sliding_window, None, kv_scales,
                         query_end=rows.prefill_end, out=out)
    return out[:t]
