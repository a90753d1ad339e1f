"""The paged SDPA reference against a naive full-attention computation."""

from __future__ import annotations

import math

import pytest
import torch

from worker.batch import ForwardBatch
from worker.model.attention import context_mask, paged_attention, store_kv

PAGE, HQ, HKV, D, NUM_PAGES = 4, 4, 2, 8, 32


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    window: int | None) -> torch.Tensor:
    """q [n, Hq, D] = the last n tokens of a sequence whose full k, v are [L, Hkv, D]."""
    n, length = q.shape[0], k.shape[0]
    k = k.repeat_interleave(HQ // HKV, dim=1)  # [L, Hq, D]
    v = v.repeat_interleave(HQ // HKV, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)  # [Hq, n, L]
    for j in range(n):
        pos = length - n + j
        for key in range(length):
            if key > pos or (window is not None and pos - key >= window):
                scores[:, j, key] = float("-inf")
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)  # [n, Hq, D]


def batch_for(requests: list[tuple[int, int, list[int]]]) -> ForwardBatch:
    """requests = (cached tokens, new tokens, pages). Builds the ForwardBatch of this step."""
    qs, seq_lens, slots, positions, table = [0], [], [], [], []
    width = max(len(p) for _, _, p in requests)
    for cached, new, pages in requests:
        positions += range(cached, cached + new)
        slots += [pages[t // PAGE] * PAGE + t % PAGE for t in range(cached, cached + new)]
        qs.append(qs[-1] + new)
        seq_lens.append(cached + new)
        table.append(pages + [0] * (width - len(pages)))
    t = qs[-1]
    return ForwardBatch(
        input_ids=torch.zeros(t, dtype=torch.long), positions=torch.tensor(positions),
        query_start=torch.tensor(qs), seq_lens=torch.tensor(seq_lens),
        page_table=torch.tensor(table), slot_mapping=torch.tensor(slots),
        logits_indices=torch.tensor(qs[1:]) - 1, query_start_list=qs, seq_lens_list=seq_lens,
    )


def check_against_naive(requests: list[tuple[int, int, list[int]]], k_cache: torch.Tensor,
                        v_cache: torch.Tensor, window: int | None) -> None:
    """Store each request's cached K/V, run one paged step, compare every request with naive."""
    full = []
    for cached, new, pages in requests:  # fill the cached part of each context first
        k_all, v_all = torch.randn(cached + new, HKV, D), torch.randn(cached + new, HKV, D)
        if cached:
            slots = torch.tensor([pages[t // PAGE] * PAGE + t % PAGE for t in range(cached)])
            store_kv(k_all[:cached], v_all[:cached], k_cache, v_cache, slots)
        full.append((k_all, v_all, torch.randn(new, HQ, D)))
    batch = batch_for(requests)
    q = torch.cat([f[2] for f in full])
    k_new = torch.cat([f[0][c:] for f, (c, _, _) in zip(full, requests, strict=True)])
    v_new = torch.cat([f[1][c:] for f, (c, _, _) in zip(full, requests, strict=True)])
    out = paged_attention(q, k_new, v_new, k_cache, v_cache, batch, scale=D**-0.5,
                          sliding_window=window)
    assert out.shape == (batch.num_tokens, HQ, D)
    for i, (k_all, v_all, qi) in enumerate(full):
        s, e = batch.query_start_list[i], batch.query_start_list[i + 1]
        torch.testing.assert_close(out[s:e], naive_attention(qi, k_all, v_all, window),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
def test_paged_matches_naive_for_mixed_prefill_chunks_and_decodes(window: int | None) -> None:
    torch.manual_seed(0)
    # (cached, new, pages): a first chunk, a mid-prefill chunk over cached pages, a decode.
    requests = [(0, 6, [9, 3]), (7, 5, [17, 2, 30]), (10, 1, [5, 21, 11])]
    check_against_naive(requests, torch.zeros(NUM_PAGES, HKV, PAGE, D),
                        torch.zeros(NUM_PAGES, HKV, PAGE, D), window)


def test_store_kv_writes_each_token_at_its_page_and_offset() -> None:
    k_cache = torch.zeros(NUM_PAGES, HKV, PAGE, D)
    v_cache = torch.zeros(NUM_PAGES, HKV, PAGE, D)
    k, v = torch.randn(3, HKV, D), torch.randn(3, HKV, D)
    slots = torch.tensor([7 * PAGE + 3, 2 * PAGE + 0, 2 * PAGE + 1])
    store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache[7, :, 3], k[0]) and torch.equal(k_cache[2, :, 0], k[1])
    assert torch.equal(v_cache[2, :, 1], v[2])
    assert int((k_cache != 0).any(-1).sum()) == 3 * HKV  # nothing else was touched


def test_context_mask_is_causal_with_offset_and_window() -> None:
    mask = context_mask(seq_len=6, num_new=2, sliding_window=None, device=torch.device("cpu"))
    assert mask is not None
    assert mask.tolist() == [[True] * 5 + [False], [True] * 6]
    windowed = context_mask(seq_len=6, num_new=1, sliding_window=3, device=torch.device("cpu"))
    assert windowed is not None and windowed.tolist() == [[False, False, False, True, True, True]]
    assert context_mask(seq_len=6, num_new=1, sliding_window=None,
                        device=torch.device("cpu")) is None


def test_batched_decode_ignores_whatever_padding_rows_hold() -> None:
    """Decodes of unequal lengths share one padded gather: page 0 (the table's padding) and the
    tails of last pages are masked, and must not leak even when they hold NaN."""
    torch.manual_seed(1)
    nan = torch.full((NUM_PAGES, HKV, PAGE, D), float("nan"))
    requests = [(9, 1, [4, 7, 12]), (2, 1, [6])]  # 10 and 3 tokens: the short one pads with page 0
    check_against_naive(requests, nan.clone(), nan.clone(), None)


def test_short_chunks_of_one_length_attend_in_one_batched_call() -> None:
    """Speculative verify steps: requests feeding k + 1 = 4 tokens each at different context
    lengths (one of 2 tokens beside them) attend batched; whatever the padding of the others'
    contexts holds (NaN here) stays out."""
    torch.manual_seed(1)
    requests = [(3, 4, [9, 3]), (13, 4, [17, 2, 30, 6, 7]), (0, 4, [5]), (7, 2, [11, 12, 13])]
    nan = float("nan")
    check_against_naive(requests, torch.full((NUM_PAGES, HKV, PAGE, D), nan),
                        torch.full((NUM_PAGES, HKV, PAGE, D), nan), None)
