"""Paged attention: store this step's K/V into the page pool, then attend over each
request's whole context.

The seam: model code calls an `AttentionBackend`; `TorchSDPABackend` is the CPU reference
(a loop over requests, torch SDPA inside), and a GPU backend (Triton paged kernels) can
replace it without touching the model. Backends receive the per-layer cache views of
`KVCache.layer(l)`: k_cache, v_cache [num_pages, num_kv_heads, page_size, head_dim].

FP8 KV (`cache.kv_cache_dtype: fp8_e4m3`): the caches are float8_e4m3fn and `kv_scales` =
(k_scale, v_scale), each [num_kv_heads] float32 (worker/model/fp8.py). The store divides by the
scale and saturates; every read dequantizes to float32 (times the scale) and attention then runs
in float32, the output cast back to q's dtype.

Causality with chunked prefill: a request with `seq_len` tokens of context after this step
and `n` new tokens has its new tokens at positions seq_len-n .. seq_len-1; new token j sees
every cached token and new tokens 0..j. Decode is the case n = 1 (no mask needed).

Attention sinks (GPT-OSS): a learned logit per query head that joins every softmax's
denominator and has no value, so a head can attend to "nothing". Every path takes an optional
`sinks` [Hq] (float32); `sdpa_with_sinks` is the reference form: one extra key whose score is the
sink (an all-zero key with the sink as its additive mask) and whose value is zero.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

from worker.batch import ForwardBatch
from worker.model.fp8 import dequantize_kv, quantize_kv

KVScales = tuple[torch.Tensor, torch.Tensor] | None  # (k_scale, v_scale) [Hkv] each; None = not FP8


def scale_args(kv_scales: KVScales, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The Triton kernels' scale arguments: (k_scale, v_scale, SCALED); `like` twice (pointers
    the kernel never reads) when the pages are not FP8."""
    if kv_scales is None:
        return like, like, False
    return kv_scales[0], kv_scales[1], True


def v_token_major(v_cache: torch.Tensor) -> bool:
    """True for a [P, Hkv, S, D] view whose tokens are adjacent in memory (FP8 pages of a
    KVCache), False for the feature-adjacent layout; anything else is refused (the Triton
    kernels read one or the other)."""
    if v_cache.stride(3) == 1:
        return False
    if v_cache.stride(2) == 1 and v_cache.stride(3) == v_cache.shape[2]:
        return True
    raise ValueError(f"v_cache [P, Hkv, S, D] must be feature- or token-major inside a page; got "
                     f"strides {tuple(v_cache.stride())}")


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    kv_scales: KVScales = None,
) -> None:
    """Write k, v [T, Hkv, D] to their slots (page * page_size + offset) in the paged cache
    (FP8 caches: divided by their scales and saturated)."""
    page_size = k_cache.shape[2]
    keep = slot_mapping >= 0  # [T]: a negative slot is not stored (its KV is cached already)
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    pages = slot_mapping // page_size  # [T]
    offsets = slot_mapping % page_size  # [T]
    # Advanced indices on dims 0 and 2 around a slice: the indexed view is [T, Hkv, D].
    if kv_scales is not None:  # no NaN in FP8 V pages (worker/model/triton_pages.py)
        k = quantize_kv(k, kv_scales[0], k_cache.dtype)
        v = quantize_kv(v.nan_to_num(nan=0.0), kv_scales[1], v_cache.dtype)
    k_cache[pages, :, offsets] = k.to(k_cache.dtype)
    v_cache[pages, :, offsets] = v.to(v_cache.dtype)


def gather_context(cache: torch.Tensor, pages: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One request's K or V from its pages: cache [P, Hkv, S, D], pages [n] → [Hkv, seq_len, D]."""
    picked = cache.index_select(0, pages)  # [n, Hkv, S, D]
    n, hkv, s, d = picked.shape
    return picked.transpose(0, 1).reshape(hkv, n * s, d)[:, :seq_len]


def context_mask(
    seq_len: int, num_new: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor | None:
    """Boolean [num_new, seq_len], True = may attend; None when every key is visible."""
    if num_new == 1 and (sliding_window is None or seq_len <= sliding_window):
        return None
    q_pos = torch.arange(seq_len - num_new, seq_len, device=device)[:, None]  # [n, 1]
    k_pos = torch.arange(seq_len, device=device)[None, :]  # [1, seq_len]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= (q_pos - k_pos) < sliding_window
    return mask


def sdpa_with_sinks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """SDPA (GQA) with optional sinks: q [B, Hq, n, D], k/v [B, Hkv, L, D], mask bool
    broadcastable to [B, Hq, n, L] (True = may attend) or None → [B, Hq, n, D].

    With sinks the softmax runs over [scores, sink]: the keys get one all-zero column (score 0)
    whose additive mask is the head's sink logit, and whose value is zero, so it only enlarges
    the denominator. That needs a float mask per head [B, Hq, n, L+1]; the CPU reference pays
    for it, the GPU kernels fold the sink into their online softmax instead.
    """
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    b, hq, n, _ = q.shape
    length = k.shape[2]
    k = torch.cat([k, k.new_zeros(b, k.shape[1], 1, k.shape[3])], dim=2)  # [B, Hkv, L+1, D]
    v = torch.cat([v, v.new_zeros(b, v.shape[1], 1, v.shape[3])], dim=2)  # [B, Hkv, L+1, D]
    bias = q.new_zeros(b, hq, n, length + 1)  # [B, Hq, n, L+1]
    if mask is not None:
        bias[..., :length].masked_fill_(~mask, float("-inf"))
    bias[..., length] = sinks.to(q.dtype)[None, :, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=True)


def sdpa_prefill(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor,
    seq_len: int, scale: float, sliding_window: int | None, kv_scales: KVScales = None,
) -> torch.Tensor:
    """One request's n new tokens: q [n, Hq, D] over its whole context → [n, Hq, D].

    Gathers the context into contiguous K/V (one copy) and calls SDPA: FlashAttention with
    plain causal masking when nothing is cached before the chunk, lower-right causal when a
    prefix is (chunked prefill, prefix-cache hits), an explicit mask under a sliding window.
    """
    n, hq, d = q.shape
    ks, vs = (None, None) if kv_scales is None else kv_scales
    # [1, Hkv, L, D]
    ctx_k = dequantize_kv(gather_context(k_cache, pages, seq_len), ks, q.dtype).to(q.dtype)[None]
    # [1, Hkv, L, D]
    ctx_v = dequantize_kv(gather_context(v_cache, pages, seq_len), vs, q.dtype).to(q.dtype)[None]
    qi = q.transpose(0, 1)[None]  # [1, Hq, n, D]
    if sliding_window is not None and seq_len > sliding_window:
        mask = context_mask(seq_len, n, sliding_window, q.device)
        o = F.scaled_dot_product_attention(qi, ctx_k, ctx_v, attn_mask=mask, scale=scale,
                                           enable_gqa=True)
    elif n == seq_len:
        o = F.scaled_dot_product_attention(qi, ctx_k, ctx_v, is_causal=True, scale=scale,
                                           enable_gqa=True)
    else:
        from torch.nn.attention.bias import causal_lower_right

        g = hq // ctx_k.shape[1]
        # CausalBias takes the flash / efficient kernels, which want equal head counts.
        # ctx_k, ctx_v: [1, Hq, L, D]
        ctx_k, ctx_v = ctx_k.repeat_interleave(g, dim=1), ctx_v.repeat_interleave(g, dim=1)
        o = F.scaled_dot_product_attention(qi, ctx_k, ctx_v,
                                           attn_mask=causal_lower_right(n, seq_len), scale=scale)
    return o[0].transpose(0, 1)  # [n, Hq, D]


class AttentionBackend(ABC):
    """What a layer needs from attention; one instance is shared by all layers."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
        v_cache: torch.Tensor, batch: ForwardBatch, scale: float, sliding_window: int | None = None,
        kv_stored: bool = False, sinks: torch.Tensor | None = None, kv_scales: KVScales = None,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (this step's tokens) → output [T, Hq, D]. k and v go to
        their slots first, unless the caller stored them already (kv_stored). sinks [Hq]: each
        head's sink logit (GPT-OSS), None = plain softmax. kv_scales: the FP8 caches'
        (k_scale, v_scale), see the module docstring."""


BATCHED_QUERY_LEN = 17  # chunks up to this long attend batched: verify steps (k + 1 <= 17)


class TorchSDPABackend(AttentionBackend):
    """Reference backend on torch SDPA (GQA native). Requests decoding one token attend in one
    batched call over their padded, masked contexts (a per-request loop costs a call per
    request per layer, which dominates a CPU decode step); so do short chunks of one length
    (speculative decoding's verify steps: the last token and k drafts); longer chunks loop."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
        v_cache: torch.Tensor, batch: ForwardBatch, scale: float, sliding_window: int | None = None,
        kv_stored: bool = False, sinks: torch.Tensor | None = None, kv_scales: KVScales = None,
    ) -> torch.Tensor:
        if not kv_stored:
            store_kv(k, v, k_cache, v_cache, batch.slot_mapping, kv_scales)
        page_size = k_cache.shape[2]
        out_dtype = q.dtype
        if kv_scales is not None:
            q = q.float()  # FP8 pages are read as float32: attention runs in float32
        ks, vs = (None, None) if kv_scales is None else kv_scales
        out = torch.empty_like(q)  # [T, Hq, D]
        qs = batch.query_start_list
        decodes: list[int] = []
        short: dict[int, list[int]] = {}  # chunk length -> requests (batched below)
        for i, seq_len in enumerate(batch.seq_lens_list):
            start, end = qs[i], qs[i + 1]
            if end - start == 1:
                decodes.append(i)
                continue
            if end == start:
                continue
            if end - start <= BATCHED_QUERY_LEN and sliding_window is None:
                short.setdefault(end - start, []).append(i)
                continue
            num_pages = -(-seq_len // page_size)
            pages = batch.page_table[i, :num_pages]
            # [Hkv, L, D]
            ctx_k = dequantize_kv(gather_context(k_cache, pages, seq_len), ks, q.dtype)
            # [Hkv, L, D]
            ctx_v = dequantize_kv(gather_context(v_cache, pages, seq_len), vs, q.dtype)
            qi = q[start:end].transpose(0, 1)  # [Hq, n, D]
            mask = context_mask(seq_len, end - start, sliding_window, q.device)
            # oi: [1, Hq, n, D]
            oi = sdpa_with_sinks(qi[None], ctx_k[None], ctx_v[None], mask, scale, sinks)
            out[start:end] = oi[0].transpose(0, 1)
        if decodes:
            # rows: [B] token index of each decode
            rows = torch.tensor([qs[i] for i in decodes], device=q.device)
            out[rows] = self._decode(q[rows], k_cache, v_cache, batch, decodes, scale,
                                     sliding_window, sinks, kv_scales)
        for n, reqs in short.items():
            idx = torch.tensor([qs[i] + j for i in reqs for j in range(n)], device=q.device)
            out[idx] = self._short(q[idx], k_cache, v_cache, batch, reqs, n, scale, sinks,
                                   kv_scales)
        return out.to(out_dtype)

    @staticmethod
    def _short(
        q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
        rows: list[int], n: int, scale: float, sinks: torch.Tensor | None,
        kv_scales: KVScales,
    ) -> torch.Tensor:
        """q [B*n, Hq, D]: n new tokens per request, each at the end of its context →
        [B*n, Hq, D], one SDPA call over the padded contexts (causal inside each)."""
        page_size = k_cache.shape[2]
        seq_lens = [batch.seq_lens_list[i] for i in rows]
        max_len = max(seq_lens)
        pages = batch.page_table[rows, : -(-max_len // page_size)]  # [B, n_pages]
        ks, vs = (None, None) if kv_scales is None else kv_scales

        def gather(cache: torch.Tensor, head_scale: torch.Tensor | None) -> torch.Tensor:
            picked = cache[pages]  # [B, n_pages, Hkv, S, D]
            b, m, hkv, s, d = picked.shape
            ctx = picked.transpose(1, 2).reshape(b, hkv, m * s, d)[:, :, :max_len]  # [B, Hkv, L, D]
            return dequantize_kv(ctx, head_scale, q.dtype)

        lens = torch.tensor(seq_lens, device=q.device)[:, None, None]  # [B, 1, 1]
        q_pos = lens - n + torch.arange(n, device=q.device)[None, :, None]  # [B, n, 1]
        k_pos = torch.arange(max_len, device=q.device)[None, None, :]  # [1, 1, L]
        mask = (k_pos <= q_pos)[:, None]  # [B, 1, n, L]
        pad = (k_pos >= lens)[:, :, :, None]  # [B, 1, L, 1]: past a request's context
        # Zero the padding (it may hold anything, and 0 * NaN = NaN even where masked).
        k = gather(k_cache, ks).masked_fill(pad, 0.0)
        v = gather(v_cache, vs).masked_fill(pad, 0.0)
        qb = q.view(len(rows), n, q.shape[1], q.shape[2]).transpose(1, 2)  # [B, Hq, n, D]
        o = sdpa_with_sinks(qb, k, v, mask, scale, sinks)  # [B, Hq, n, D]
        return o.transpose(1, 2).reshape(len(rows) * n, q.shape[1], q.shape[2])

    @staticmethod
    def _decode(
        q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
        rows: list[int], scale: float, sliding_window: int | None,
        sinks: torch.Tensor | None = None, kv_scales: KVScales = None,
    ) -> torch.Tensor:
        """q [B, Hq, D], one token per request → [B, Hq, D] over each request's padded context."""
        page_size = k_cache.shape[2]
        seq_lens = [batch.seq_lens_list[i] for i in rows]
        max_len = max(seq_lens)
        num_pages = -(-max_len // page_size)
        # pages: [B, n]; padding entries point at page 0, masked below
        pages = batch.page_table[rows, :num_pages]

        def gather(cache: torch.Tensor, head_scale: torch.Tensor | None) -> torch.Tensor:
            picked = cache[pages]  # [B, n, Hkv, S, D]
            b, n, hkv, s, d = picked.shape
            ctx = picked.transpose(1, 2).reshape(b, hkv, n * s, d)[:, :, :max_len]  # [B, Hkv, L, D]
            return dequantize_kv(ctx, head_scale, q.dtype)

        mask = None  # every key visible: equal lengths and no window in reach
        if min(seq_lens) < max_len or (sliding_window is not None and max_len > sliding_window):
            lens = torch.tensor(seq_lens, device=q.device)[:, None]  # [B, 1]
            k_pos = torch.arange(max_len, device=q.device)[None, :]  # [1, L]
            keep = k_pos < lens  # [B, L]
            if sliding_window is not None:
                keep &= (lens - 1 - k_pos) < sliding_window
            mask = keep[:, None, None, :]  # [B, 1, 1, L]
        ks, vs = (None, None) if kv_scales is None else kv_scales
        k, v = gather(k_cache, ks), gather(v_cache, vs)
        if mask is not None:
            # A masked key still enters the scores (NaN + -inf = NaN) and its value the sum
            # (0 * NaN = NaN): padding rows (page 0, page tails) may hold anything, so zero them.
            pad = ~mask[:, :, 0, :, None]  # [B, 1, L, 1]
            k, v = k.masked_fill(pad, 0.0), v.masked_fill(pad, 0.0)
        o = sdpa_with_sinks(q[:, :, None], k, v, mask, scale, sinks)  # [B, Hq, 1, D]
        return o[:, :, 0]


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    batch: ForwardBatch, scale: float, sliding_window: int | None = None,
    sinks: torch.Tensor | None = None, kv_scales: KVScales = None,
) -> torch.Tensor:
    """The CPU reference in one call: q [T,Hq,D], k/v [T,Hkv,D] → [T,Hq,D] (see module doc)."""
    return TorchSDPABackend().forward(q, k, v, k_cache, v_cache, batch, scale, sliding_window,
                                      sinks=sinks, kv_scales=kv_scales)


def window_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    batch: ForwardBatch, scale: float, window: int, sinks: torch.Tensor | None = None,
    kv_scales: KVScales = None,
) -> torch.Tensor:
    """A window layer over its ring of pages: q [T,Hq,D], k/v [T,Hkv,D] → [T,Hq,D].

    The ring holds only the last W tokens (fewer than a chunk may add), so each request attends
    to its history read from the ring (`window_context_slots`: the up to W-1 tokens before its
    chunk) plus this step's K/V straight from the projections, and the new K/V are stored only
    after every request has read its history (a chunk longer than the ring overwrites slots that
    its own first queries still need). Works on any device (plain torch ops). sinks [Hq]: as in
    `sdpa_with_sinks` (GPT-OSS's sliding layers have them too).
    """
    assert batch.window_context_slots is not None and batch.window_context_start is not None
    assert batch.window_slot_mapping is not None
    page_size = k_cache.shape[2]
    hist_pages = batch.window_context_slots // page_size  # [C]
    hist_offsets = batch.window_context_slots % page_size  # [C]
    out_dtype = q.dtype
    ks, vs = (None, None) if kv_scales is None else kv_scales
    if ks is not None and vs is not None:  # FP8 ring pages: history and this step's K/V in f32
        # This step's K/V as the ring will hold them (e4m3), as full layers read theirs back:
        # otherwise where a step boundary falls (batch composition) changes the output.
        k_now = quantize_kv(k, ks, k_cache.dtype).float() * ks.float()[:, None]  # [T, Hkv, D]
        v_now = quantize_kv(v.nan_to_num(nan=0.0), vs, v_cache.dtype).float() * vs.float()[:, None]
        q = q.float()
    else:
        k_now, v_now = k, v
    # [C, Hkv, D] each (dequantize_kv wants heads before tokens: transpose around it)
    hist_k = dequantize_kv(k_cache[hist_pages, :, hist_offsets].transpose(0, 1), ks,
        q.dtype).transpose(0, 1)
    hist_v = dequantize_kv(v_cache[hist_pages, :, hist_offsets].transpose(0, 1), vs,
        q.dtype).transpose(0, 1)
    out = torch.empty_like(q)  # [T, Hq, D]
    qs, hs = batch.query_start_list, batch.window_context_start
    for i in range(batch.num_requests):
        start, end = qs[i], qs[i + 1]
        if end == start:
            continue
        n, h = end - start, hs[i + 1] - hs[i]
        # ctx_k, ctx_v: [Hkv, h+n, D]
        ctx_k = torch.cat([hist_k[hs[i] : hs[i + 1]], k_now[start:end]]).transpose(0, 1)
        ctx_v = torch.cat([hist_v[hs[i] : hs[i + 1]], v_now[start:end]]).transpose(0, 1)
        mask = None
        if n > 1 or h >= window:
            # q_pos: [n, 1], relative to the history start
            q_pos = torch.arange(h, h + n, device=q.device)[:, None]
            k_pos = torch.arange(h + n, device=q.device)[None, :]  # [1, h+n]
            mask = (k_pos <= q_pos) & ((q_pos - k_pos) < window)  # [n, h+n]
        qi = q[start:end].transpose(0, 1)[None]  # [1, Hq, n, D]
        oi = sdpa_with_sinks(qi, ctx_k[None], ctx_v[None], mask, scale, sinks)  # [1, Hq, n, D]
        out[start:end] = oi[0].transpose(0, 1)
    store_kv(k, v, k_cache, v_cache, batch.window_slot_mapping, kv_scales)
    return out.to(out_dtype)
