"""The paged decode kernels: Triton store and split-K decode over the page-major KV pool.

- store (`triton_store_kv`): one Triton program per new token writes its K and V for every kv
  head into the slot `slot_mapping[t]` (page * page_size + offset). A negative slot is skipped:
  CUDA-graph padding rows use -1 so a padded row never touches a real page.
- decode (`triton_paged_decode`, every request has one new token): a split-K paged kernel, one
  program per (request, kv head, split). A program loads its group of G = Hq / Hkv query heads
  once and streams its share of the request's context straight out of the pages (the per-layer
  K/V views of `KVCache.layer` are strided: no gather, no copy), online softmax in float32.
  With more than one split, a second kernel merges the partial outputs by their log-sum-exp.
  The split count depends only on the batch size and the page dtype (a CUDA graph captures it),
  chosen so that B * Hkv * splits fills the GPU (`decode_launch`); a split whose share is empty
  writes only its log-sum-exp (-inf), and the merge reads no partial row of such a split.
- attention sinks (GPT-OSS, `sinks` [Hq] float32): the decode kernel's split 0 starts its online
  softmax at the sink (running max = sink, sum = 1, no value), so the merge folds it in like any
  other split.

FP8 KV pages (`kv_scales` given): the store divides by each head's scale and saturates before
the e4m3 store; the decode kernel converts each K/V block to float16 in registers and folds the
head's K scale into the softmax scale and its V scale into the output, so FP8 costs one
conversion per element and halves the bytes it streams.

worker/model/triton_attention.py is the backend that calls them. Triton is imported lazily so
that this module (and its CPU-side helpers) imports without it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from worker.model.attention import KVScales, scale_args, v_token_major
from worker.model.fused import next_pow2

# The decode kernel's settings by page dtype (False: 16/32-bit pages, True: e4m3): context
# tokens per iteration, pipeline depth and warps; over e4m3 pages both dots in float16
# (F16_DOT). bench/decode_kernel.py (H200, 32k context,
# calls replayed in a CUDA graph): bf16 pages stream fastest in 64-token blocks over 2 stages
# (4,320 GB/s at batch 8), e4m3 pages with token-major V in 128-token blocks over 2 stages
# (3,820 GB/s at batch 8 against 3,216 over 3). Over e4m3 pages (V token-major, as a KVCache
# keeps them) the kernel takes 130 registers uncapped, 3 programs an SM; capped at 128
# (`maxnreg`, no spills) 4 fit, and a split batch's 512 programs are one wave: -0.5 to +1.2%
# GB/s over the shapes of `bench.decode_kernel --check` (two processes), and with the
# few-token rope tiles (fused_rope.py) +1.07% batch-1 tok/s at 32k in one process
# (bench/fp8.py longctx_ab; H200, 2026-12-05).
DECODE_CONFIGS: dict[bool, dict[str, int]] = {
    False: dict(BLOCK_N=64, num_stages=2, num_warps=4, F16_DOT=False),
    True: dict(BLOCK_N=128, num_stages=2, num_warps=4, F16_DOT=True, maxnreg=128),
}
# How far the decode kernel splits a request's context, whatever the page dtype: (programs
# aimed at, most splits); see num_decode_splits. Same sweeps (graph-timed, best of three): at
# batch 1, 64 splits read 3,364 GB/s over bf16 pages and 2,440 over e4m3 ones at 32k, against
# 2,855 and 2,234 with 32 (and 3,161 and 2,341 with 48: no split count between powers of two
# does better); at batch 8, 8 splits read 4,318 and 3,932 GB/s at 32k and 2,463 over e4m3 pages
# at 4k, against 16 splits' 4,307, 3,832 and 2,167. Over feature-major e4m3 V (before
# token-major V) twice the programs paid: its tiles cost bf16's math for half the bytes.
DECODE_SPLITS = (528, 64)
# A batch of e4m3 pages whose B * Hkv programs reach this runs unsplit over 64-token blocks, as
# bf16 pages do there (their split rule gives one split at 528): `python3 -m
# bench.decode_kernel --ctx 576 --splits 64=1,2,4` (H200, batch 64): 2,172 GB/s against 1,774
# for the rule's two splits of 128-token blocks, which leave a short context's last block mostly
# masked; at 2,048 context the two read the same (2,472 and 2,471).
FP8_UNSPLIT_PROGRAMS = 512
# The split rule fills an H200's SMs. On CPU tensors (Triton's interpreter, the CI's check of
# the kernels) a program costs ~20 ms of Python each: at most 4 splits, still merged.
_INTERPRETER_SPLITS = 4


def decode_launch(
    batch_size: int, num_kv_heads: int, fp8_pages: bool, max_splits: int | None = None
) -> tuple[int, dict[str, Any]]:
    """The decode kernel's split count and settings for a batch (a CUDA graph captures both):
    DECODE_SPLITS' rule and DECODE_CONFIGS by page dtype, but e4m3 pages with at least
    FP8_UNSPLIT_PROGRAMS programs unsplit in 64-token blocks. `max_splits` caps the rule."""
    cfg = DECODE_CONFIGS[fp8_pages]
    if fp8_pages and batch_size * num_kv_heads >= FP8_UNSPLIT_PROGRAMS:
        return 1, cfg | dict(BLOCK_N=64)
    target, most = DECODE_SPLITS
    most = most if max_splits is None else min(most, max_splits)
    return num_decode_splits(batch_size, num_kv_heads, target, most), cfg


def num_decode_splits(
    batch_size: int, num_kv_heads: int, target: int = 528, max_splits: int = 32
) -> int:
    """Split-K factor for a decode kernel: a power of two, doubled while B * Hkv * splits stays
    within half of `target` programs (528: ~4 per SM of an H200's 132), at most `max_splits`."""
    programs = max(1, batch_size * num_kv_heads)
    splits = 1
    while programs * splits * 2 <= target and splits < max_splits:
        splits *= 2
    return splits


@functools.cache
def _get_kernels() -> dict[str, Any]:
    """Compile-on-first-use: define the Triton kernels only when a GPU backend runs."""
    import triton
    import triton.language as tl

    @triton.jit
    def store_kv_kernel(
        k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr,
        stride_kt, stride_kh, stride_vt, stride_vh,
        stride_cp, stride_ch, stride_cs,
        stride_vcp, stride_vch, stride_vcs, stride_vcd,
        HKV: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
        SCALED: tl.constexpr,
    ):
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t)
        page = tl.maximum(slot, 0) // PAGE
        off = tl.maximum(slot, 0) % PAGE
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, D)
        # [BH, D]; slot -1: a CUDA-graph padding row writes nothing (no heads). Built from
        # comparisons only: Triton's interpreter widens `bool & scalar bool` to int32.
        live = tl.where(slot >= 0, HKV, 0)
        hm = (h < live)[:, None] & (d < D)[None, :]
        k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=hm)  # [BH, D]
        v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=hm)
        if SCALED:  # FP8 pages: value / its head's scale, saturated at the largest e4m3 value
            ks = tl.load(ks_ptr + h, mask=h < HKV, other=1.0)[:, None]
            vs = tl.load(vs_ptr + h, mask=h < HKV, other=1.0)[:, None]
            # div_rn: IEEE division, as the torch reference divides (`/` is approximate).
            k = tl.clamp(tl.math.div_rn(k.to(tl.float32), ks), -448.0, 448.0)
            v = tl.math.div_rn(v.to(tl.float32), vs)
            # no NaN in V pages (worker/model/triton_pages.py): 0, as the torch store writes;
            # the clamp alone would make it 448 on a GPU
            v = tl.clamp(tl.where(v == v, v, 0.0), -448.0, 448.0)
        kc = kc_ptr + page * stride_cp + off * stride_cs + h[:, None] * stride_ch + d[None, :]
        vc = (vc_ptr + page * stride_vcp + off * stride_vcs + h[:, None] * stride_vch
              + d[None, :] * stride_vcd)
        tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=hm)
        tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=hm)

    @triton.jit
    def decode_kernel(
        q_ptr, kc_ptr, vc_ptr, pt_ptr, sl_ptr, o_ptr, op_ptr, lse_ptr, sinks_ptr, ks_ptr, vs_ptr,
        stride_qt, stride_qh,
        stride_kp, stride_kh, stride_ks,
        stride_vp, stride_vh, stride_vs,
        stride_ptb,
        stride_ot, stride_oh,
        scale_log2, window,
        G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_SINKS: tl.constexpr,
        SCALED: tl.constexpr, F16_DOT: tl.constexpr, V_T: tl.constexpr,
        LOAD_V: tl.constexpr,  # triton_pages.load_v_token_major
    ):
        b = tl.program_id(0)
        hkv = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(sl_ptr + b).to(tl.int32)
        lo = 0
        if window > 0:
            lo = tl.maximum(seq_len - window, 0)
        span = seq_len - lo
        per_split = tl.cdiv(tl.cdiv(span, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = lo + split * per_split
        end = tl.minimum(start + per_split, seq_len)

        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, D)
        heads = hkv * G + g  # this program's query heads
        gmask = g < G
        q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=gmask[:, None], other=0.0)
        if F16_DOT:  # e4m3 → float16 is one conversion per pair (to bfloat16: several)
            q = q.to(tl.float16)
        v_scale = 1.0
        if SCALED:  # FP8 pages: K's scale joins the softmax scale, V's scales the output
            scale_log2 = scale_log2 * tl.load(ks_ptr + hkv)
            v_scale = tl.load(vs_ptr + hkv)

        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_sum = tl.zeros([BLOCK_G], tl.float32)
        if HAS_SINKS:  # noqa: SIM102 - constexpr apart: the kernel without sinks has no branch
            if split == 0:  # the sink joins one split's softmax: a logit with no value
                sink = tl.load(sinks_ptr + heads, mask=gmask, other=float("-inf"))
                m = sink.to(tl.float32) * 1.4426950408889634  # log2 domain, like the scores
                l_sum = tl.where(gmask, 1.0, 0.0)  # exp2(sink - m) = 1
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        first = start
        if V_T:  # V read by whole pages: start on a page boundary, earlier tokens get no weight
            first = tl.where(start < end, start - start % PAGE, end)  # (an empty split reads none)
        for n0 in range(first, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            valid = (n >= start) & (n < end)
            page = tl.load(pt_ptr + b * stride_ptb + n // PAGE, mask=valid, other=0).to(tl.int64)
            off = n % PAGE
            k = tl.load(
                kc_ptr + page[:, None] * stride_kp + hkv * stride_kh + off[:, None] * stride_ks
                + d[None, :],
                mask=valid[:, None], other=0.0,
            )  # [BN, D]
            if V_T:  # token-major pages (FP8): 16-byte runs of one feature, [BN, D]
                v = LOAD_V(vc_ptr, pt_ptr + b * stride_ptb, n0, end, stride_vp, hkv * stride_vh,
                           D, PAGE, BLOCK_N)
            else:
                v = tl.load(
                    vc_ptr + page[:, None] * stride_vp + hkv * stride_vh
                    + off[:, None] * stride_vs + d[None, :],
                    mask=valid[:, None], other=0.0,
                )  # [BN, D]
            if SCALED:
                k = k.to(q.dtype)  # e4m3 → q's dtype in registers
                v = v.to(q.dtype)
                if not V_T:
                    # Feature-major e4m3 V (not a KVCache's): masked after the conversion, V
                    # stays in the load's layout as float16 and reaches the dot through
                    # ldmatrix.trans; unmasked, Triton (3.7-3.9) moves the conversion past the
                    # layout change and gathers e4m3 bytes from shared memory one at a time
                    # (bench/sass.py: 128 single-byte loads; H200: 1.02-1.06x at long contexts).
                    v = tl.where(valid[:, None], v, 0.0)
            s = tl.dot(q, tl.trans(k)) * scale_log2  # [BG, BN], log2 domain
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m - m_new)
            l_sum = l_sum * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new

        has = l_sum > 0
        out = acc / tl.where(has, l_sum, 1.0)[:, None] * v_scale
        if NUM_SPLITS == 1:
            tl.store(
                o_ptr + b * stride_ot + heads[:, None] * stride_oh + d[None, :],
                out.to(o_ptr.dtype.element_ty), mask=gmask[:, None],
            )
        else:
            # partials: op [B, Hq, NUM_SPLITS, D] fp32, lse [B, Hq, NUM_SPLITS] fp32 (log2 domain).
            # An empty split (a short context's tail) writes its lse (-inf) only: the merge
            # reads no partial row whose lse is -inf.
            row = (b * (tl.num_programs(1) * G) + heads) * NUM_SPLITS + split  # [BG]
            tl.store(op_ptr + row[:, None] * D + d[None, :], out, mask=(gmask & has)[:, None])
            lse = tl.where(has, m + tl.log2(tl.where(has, l_sum, 1.0)), float("-inf"))
            tl.store(lse_ptr + row, lse, mask=gmask)

    @triton.jit
    def merge_kernel(
        op_ptr, lse_ptr, o_ptr, stride_ot, stride_oh, HQ: tl.constexpr, D: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.arange(0, NUM_SPLITS)
        d = tl.arange(0, D)
        row = (b * HQ + h) * NUM_SPLITS + sp  # [NS]
        lse = tl.load(lse_ptr + row)  # [NS]
        mx = tl.max(lse, 0)
        held = lse > float("-inf")  # [NS]: the splits that saw tokens (or a sink)
        w = tl.where(held, tl.exp2(lse - mx), 0.0)  # [NS]; all-empty rows get 0
        # [NS, D]: an empty split's row is neither written nor read
        parts = tl.load(op_ptr + row[:, None] * D + d[None, :], mask=held[:, None], other=0.0)
        den = tl.sum(w, 0)
        out = tl.sum(parts * w[:, None], 0) / tl.where(den > 0, den, 1.0)
        tl.store(o_ptr + b * stride_ot + h * stride_oh + d, out.to(o_ptr.dtype.element_ty))

    return {"store": store_kv_kernel, "decode": decode_kernel, "merge": merge_kernel}


def triton_store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    kv_scales: KVScales = None,
) -> None:
    """k, v [T, Hkv, D] → their slots in k_cache / v_cache [P, Hkv, S, D]; slot < 0 is skipped.
    FP8 caches take kv_scales = (k_scale, v_scale) [Hkv] float32."""
    t, hkv, d = k.shape
    if t == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(3) == 1
    v_token_major(v_cache)  # either V layout (raises for another)
    ks, vs, scaled = scale_args(kv_scales, slot_mapping)
    _get_kernels()["store"][(t,)](
        k, v, k_cache, v_cache, slot_mapping, ks, vs,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        HKV=hkv, BLOCK_H=next_pow2(hkv), D=d, PAGE=k_cache.shape[2], SCALED=scaled,
    )


def triton_paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
    num_splits: int | None = None, sinks: torch.Tensor | None = None, kv_scales: KVScales = None,
    **config: int,
) -> torch.Tensor:
    """One new token per request: q [B, Hq, D] over its pages → out [B, Hq, D] (q's dtype).
    FP8 caches take kv_scales = (k_scale, v_scale) [Hkv] float32; their K/V tiles become
    float16 in registers and both dots run in float16 (float32 accumulation). `config`
    overrides DECODE_CONFIGS (BLOCK_N, num_stages, num_warps, F16_DOT; for the benches).

    page_table [B, max_pages] and seq_lens [B] (a row with seq_len 0 gives zeros). sinks [Hq]
    float32 or None. Reads no host value, so it can be captured in a CUDA graph (the sinks are
    a parameter: a fixed address).
    """
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    assert hq % hkv == 0, f"num q heads {hq} is not a multiple of kv heads {hkv}"
    g = hq // hkv
    ks, vs, scaled = scale_args(kv_scales, seq_lens)
    # Triton's interpreter runs the programs one after another: few splits on CPU tensors
    rule, cfg = decode_launch(b, hkv, scaled, None if q.is_cuda else _INTERPRETER_SPLITS)
    splits = num_splits or rule
    cfg = cfg | config
    v_t = v_token_major(v_cache)
    if not v_t:  # feature-major e4m3 V (not a KVCache's) spills at 128 registers: no cap
        cfg.pop("maxnreg", None)
    out = torch.empty_like(q)
    if b == 0:
        return out
    q = q if q.stride(2) == 1 else q.contiguous()
    kern = _get_kernels()
    from worker.model.triton_pages import load_v_token_major  # imports triton: launch time only
    if splits > 1:
        # partial: [B, Hq, NS, D]
        partial = torch.empty(b, hq, splits, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(b, hq, splits, dtype=torch.float32, device=q.device)  # [B, Hq, NS]
    else:
        partial = lse = out  # unused by the kernel when NUM_SPLITS == 1
    kern["decode"][(b, hkv, splits)](
        q, k_cache, v_cache, page_table, seq_lens, out, partial, lse, q if sinks is None else sinks,
        ks, vs,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        page_table.stride(0),
        out.stride(0), out.stride(1),
        scale * 1.4426950408889634,  # log2(e): the kernel works in base 2 (exp2 is one instruction)
        sliding_window or 0,
        G=g, BLOCK_G=max(16, next_pow2(g)), D=d, PAGE=k_cache.shape[2],
        NUM_SPLITS=splits, HAS_SINKS=sinks is not None, SCALED=scaled,
        V_T=v_t, LOAD_V=load_v_token_major, **cfg,
    )
    if splits > 1:
        kern["merge"][(b, hq)](partial, lse, out, out.stride(0), out.stride(1), HQ=hq, D=d,
                               NUM_SPLITS=splits)
    return out
