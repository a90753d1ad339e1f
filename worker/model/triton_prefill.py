"""A Triton paged-attention kernel for multi-token steps, with attention sinks and windows.

Why a kernel of its own: GPT-OSS's sink logit joins every softmax's denominator, and torch SDPA
has no such term; and a mixed step's short prompts and chunks, through SDPA, cost a context
gather and ~5 launches each per layer. This kernel reads the context straight out of the pages
(no gather), every request of the step in one launch, and runs one online softmax per query row;
with sinks it starts at the sink: running max = sink, running sum = 1, no value. FP8 pages:
each K/V block becomes q's dtype in registers, the head's K scale joins the softmax scale and
its V scale the output.

Layout of one launch: program (request b, query head h, block of BLOCK_M query rows). Request b
owns rows `query_start[b] : query_end[b]` of q (query_end defaults to query_start[1:]; a subset
of a step's requests passes both); its new tokens sit at positions
`seq_len - n .. seq_len - 1`, so row r (its position p) may see keys `k <= p` and, under a
sliding window W, `p - k < W`. A program loops over the key span its block can see, BLOCK_N
keys at a time; a block past the request's rows has an empty span and stores nothing. Rows of
any length work, one-token (decode) rows included, so a mixed step is one launch.

Triton is imported lazily so that this module imports without it; `TRITON_INTERPRET=1` runs the
kernel on CPU tensors (tests/worker/test_gpt_oss_kernels.py checks it against the torch
reference there).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from worker.model.attention import KVScales, scale_args, v_token_major

_BLOCK_M = 32  # query rows per program
_BLOCK_N = 32  # context tokens per inner-loop iteration
_LOG2E = 1.4426950408889634  # the kernel works in base 2 (exp2 is one instruction)

@functools.cache
def _get_kernel() -> Any:
    """Compile-on-first-use: define the kernel only when a GPU (or the interpreter) runs it."""
    import triton
    import triton.language as tl

    @triton.jit
    def prefill_kernel(
        q_ptr,
        kc_ptr,
        vc_ptr,
        pt_ptr,
        qs_ptr,
        qe_ptr,
        sl_ptr,
        sinks_ptr,
        ks_ptr,
        vs_ptr,
        o_ptr,
        stride_qt,
        stride_qh,
        stride_kp,
        stride_kh,
        stride_ks,
        stride_vp,
        stride_vh,
        stride_vs,
        stride_ptb,
        stride_ot,
        stride_oh,
        scale_log2,
        window,
        G: tl.constexpr,
        D: tl.constexpr,
        PAGE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HAS_SINKS: tl.constexpr,
        SCALED: tl.constexpr,
        PRECISION: tl.constexpr,
        V_T: tl.constexpr,
        LOAD_V: tl.constexpr,  # triton_pages.load_v_token_major
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        hkv = h // G
        q_start = tl.load(qs_ptr + b)
        n = tl.load(qe_ptr + b) - q_start
        seq_len = tl.load(sl_ptr + b)
        rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] row within the request
        row_ok = rows < n
        q_pos = seq_len - n + rows  # [BM] absolute positions
        d = tl.arange(0, D)
        q = tl.load(
            q_ptr + (q_start + rows)[:, None] * stride_qt + h * stride_qh + d[None, :],
            mask=row_ok[:, None],
            other=0.0,
        )  # [BM, D]
        if SCALED:  # FP8 pages: the head's K scale joins the softmax scale, its V scale the output
            scale_log2 = scale_log2 * tl.load(ks_ptr + hkv)
        # The keys this block can see: up to its last row's position, from its first row's window.
        first = seq_len - n + tl.program_id(2) * BLOCK_M
        hi = tl.minimum(first + BLOCK_M, seq_len)
        # One expression (not an `if`): `first` is int64 here, a literal 0 would be int32.
        lo = tl.where(window > 0, tl.maximum(first - window + 1, 0), 0)
        hi = tl.where(first < seq_len, hi, lo)  # a block past the request's rows: no keys

        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_sum = tl.zeros([BLOCK_M], tl.float32)
        if HAS_SINKS:
            m = (
                tl.zeros([BLOCK_M], tl.float32)
                + tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
            )
            l_sum = tl.zeros([BLOCK_M], tl.float32) + 1.0  # exp2(sink - m) = 1, no value
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        first_key = lo
        if V_T:  # V read by whole pages: start on a page boundary, earlier keys get no weight
            first_key = tl.where(lo < hi, lo - lo % PAGE, hi)  # (no keys: no pages either)
        for n0 in range(first_key, hi, BLOCK_N):
            kpos = n0 + tl.arange(0, BLOCK_N)  # [BN]
            k_ok = (kpos >= lo) & (kpos < hi)
            page = tl.load(pt_ptr + b * stride_ptb + kpos // PAGE, mask=k_ok, other=0).to(tl.int64)
            off = kpos % PAGE
            k = tl.load(
                kc_ptr
                + page[:, None] * stride_kp
                + hkv * stride_kh
                + off[:, None] * stride_ks
                + d[None, :],
                mask=k_ok[:, None],
                other=0.0,
            ).to(q.dtype)  # [BN, D]
            if V_T:  # token-major pages (FP8): 16-byte runs of one feature, [BN, D]
                v = LOAD_V(vc_ptr, pt_ptr + b * stride_ptb, n0, hi, stride_vp, hkv * stride_vh,
                           D, PAGE, BLOCK_N).to(q.dtype)
            else:
                v = tl.load(
                    vc_ptr
                    + page[:, None] * stride_vp
                    + hkv * stride_vh
                    + off[:, None] * stride_vs
                    + d[None, :],
                    mask=k_ok[:, None],
                    other=0.0,
                ).to(q.dtype)  # [BN, D]
                if SCALED:  # e4m3 V's conversion before its layout change (decode_kernel's note)
                    v = tl.where(k_ok[:, None], v, 0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BM, BN]
            seen = k_ok[None, :] & (kpos[None, :] <= q_pos[:, None])
            if window > 0:
                seen = seen & ((q_pos[:, None] - kpos[None, :]) < window)
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m - m_safe)
            l_sum = l_sum * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
            m = m_new
        out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
        if SCALED:
            out = out * tl.load(vs_ptr + hkv)
        tl.store(
            o_ptr + (q_start + rows)[:, None] * stride_ot + h * stride_oh + d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=row_ok[:, None],
        )

    return prefill_kernel


def triton_paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    kv_scales: KVScales = None,
    query_end: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every request's new tokens over its pages: q [T, Hq, D] → out [T, Hq, D] (q's dtype).

    k_cache / v_cache [P, Hkv, page_size, D] (this step's K/V already stored), page_table
    [B, max_pages], query_start [B+1] and seq_lens [B] on q's device; max_query_len: the longest
    request's new tokens (sizes the grid); sinks [Hq] float32 or None; kv_scales: FP8 pages'
    (k_scale, v_scale) [Hkv]. A subset of a step's requests: query_start [B] their first rows
    and query_end [B] one past their last; only those rows of `out` (given, or a new tensor)
    are written.
    """
    t, hq, d = q.shape
    b = seq_lens.shape[0]
    hkv = k_cache.shape[1]
    assert hq % hkv == 0, f"num q heads {hq} is not a multiple of kv heads {hkv}"
    assert k_cache.stride(3) == 1
    out = torch.empty_like(q) if out is None else out
    if t == 0 or b == 0:
        return out
    q = q if q.stride(2) == 1 else q.contiguous()
    ends = query_start[1:] if query_end is None else query_end
    ks, vs, scaled = scale_args(kv_scales, seq_lens)
    grid = (b, hq, -(-max_query_len // _BLOCK_M))
    from worker.model.triton_pages import load_v_token_major  # imports triton: launch time only

    _get_kernel()[grid](
        q,
        k_cache,
        v_cache,
        page_table,
        query_start,
        ends,
        seq_lens,
        q if sinks is None else sinks,
        ks,
        vs,
        out,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        page_table.stride(0),
        out.stride(0),
        out.stride(1),
        scale * _LOG2E,
        sliding_window or 0,
        G=hq // hkv,
        D=d,
        PAGE=k_cache.shape[2],
        BLOCK_M=_BLOCK_M,
        BLOCK_N=_BLOCK_N,
        HAS_SINKS=sinks is not None,
        SCALED=scaled,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        V_T=v_token_major(v_cache),
        LOAD_V=load_v_token_major,
        num_warps=4,
        num_stages=2,
    )
    return out
