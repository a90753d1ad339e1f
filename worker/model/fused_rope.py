"""Fused q/k norm, RoPE and K/V store for the decoder's attention (CUDA), one Triton kernel.

`qk_norm_rope(qkv, ...)` works in place on the q|k|v projection output, for every q and k
head: Qwen3's per-head RMSNorm (when weights are given), then neox (rotate-half) RoPE from the
step's cos/sin — so every RoPE variant of worker/model/rope.py (default, linear, llama3, yarn,
dynamic) takes this path, as all of them end in the same cos/sin table. Given the layer's
caches and slots (`kv_cache=`), it also writes the new k and v to their slots, so the attention
backend's store kernel is skipped. FP8 caches (`kv_scales=`): each value is divided by its
head's scale and saturated at ±448 before the e4m3 store, as attention.store_kv does.

Numerics follow the torch reference step by step (layers.py `RMSNorm`, rope.py `apply_rope`,
attention.store_kv) as worker/model/fused.py's kernels do; the torch code stays the CPU
reference. `TRITON_INTERPRET=1` runs the kernel on CPU tensors for debugging.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from worker.model.fused import next_pow2

_ROPE_TILE = 1024  # elements of q/k heads per program (8 heads of 128)
# Steps of at most FEW_TOKENS tokens give a program FEW_TOKENS_HEADS heads: more programs for
# little work, so that a decode step's store into token-major FP8 V pages (a byte per
# feature, each in its own 16-byte run: 1,024 scattered writes a token for 8 heads of 128) is
# not one program's.
FEW_TOKENS, FEW_TOKENS_HEADS = 8, 2


@functools.cache
def _kernels() -> SimpleNamespace:
    """Compile-on-first-use: triton is imported only when the kernel first runs."""
    import triton
    import triton.language as tl

    @triton.jit
    def qk_norm_rope_kernel(
        qkv_ptr,
        cos_ptr,
        sin_ptr,
        qw_ptr,
        kw_ptr,
        kc_ptr,
        vc_ptr,
        slot_ptr,
        ks_ptr,
        vs_ptr,
        stride_t,
        stride_cos,
        stride_sin,
        stride_kcp,
        stride_kch,
        stride_kcs,
        stride_vcp,
        stride_vch,
        stride_vcs,
        stride_vcd,
        eps,
        HQ: tl.constexpr,
        HEADS: tl.constexpr,
        HKV: tl.constexpr,
        HALF: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        BLOCK_H: tl.constexpr,
        HAS_NORM: tl.constexpr,
        STORE: tl.constexpr,
        PAGE: tl.constexpr,
        SCALED: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(
            0, BLOCK_H
        )  # [BH] head index: q heads, k, then v
        i = tl.arange(0, BLOCK_HALF)  # [BHALF] position in each half of the head
        imask = i < HALF
        rot = h < HEADS  # q and k heads are normalized and rotated; v heads (STORE only) are copied
        mask = ((h < HEADS + HKV) if STORE else rot)[:, None] & imask[None, :]  # [BH, BHALF]
        dtype = qkv_ptr.dtype.element_ty
        # q, k and v heads sit back to back in each row: head h at h * head_dim.
        first = qkv_ptr + t * stride_t + h[:, None] * (2 * HALF) + i[None, :]  # [BH, BHALF]
        x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
        y1, y2 = x1, x2
        if HAS_NORM:
            rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
            is_q = (h < HQ)[:, None]
            w1 = tl.where(
                is_q,
                tl.load(qw_ptr + i, mask=imask, other=0.0)[None, :],
                tl.load(kw_ptr + i, mask=imask, other=0.0)[None, :],
            ).to(tl.float32)
            w2 = tl.where(
                is_q,
                tl.load(qw_ptr + HALF + i, mask=imask, other=0.0)[None, :],
                tl.load(kw_ptr + HALF + i, mask=imask, other=0.0)[None, :],
            ).to(tl.float32)
            y1 = (w1 * (x1 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            y2 = (w2 * (x2 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        # cos/sin rows repeat their first half (rope.py duplicates the frequencies): read it once.
        cos = tl.load(cos_ptr + t * stride_cos + i, mask=imask, other=0.0)[None, :]
        sin = tl.load(sin_ptr + t * stride_sin + i, mask=imask, other=0.0)[None, :]
        r1 = (y1 * cos - y2 * sin).to(dtype)
        r2 = (y2 * cos + y1 * sin).to(dtype)
        y1, y2 = r1, r2
        rmask = rot[:, None] & mask
        tl.store(first, y1, mask=rmask)
        tl.store(first + HALF, y2, mask=rmask)
        if STORE:
            # the new k (rotated) and v into their cache slot;
            # slot < 0 (graph padding) writes nothing
            slot = tl.load(slot_ptr + t)
            page = tl.maximum(slot, 0) // PAGE
            off = tl.maximum(slot, 0) % PAGE
            is_k = rot & (h >= HQ)
            is_v = h >= HEADS
            k_at = (
                kc_ptr
                + page * stride_kcp
                + off * stride_kcs
                + (h - HQ)[:, None] * stride_kch
                + i[None, :]
            )
            v_at = (
                vc_ptr
                + page * stride_vcp
                + off * stride_vcs
                + (h - HEADS)[:, None] * stride_vch
                + i[None, :] * stride_vcd
            )
            # Comparisons only (Triton's interpreter widens `bool & scalar bool` to int32).
            live = (h < tl.where(slot >= 0, HEADS + HKV, 0))[:, None]  # slot -1: no head stores
            kmask = is_k[:, None] & mask & live
            vmask = is_v[:, None] & mask & live
            cache = kc_ptr.dtype.element_ty
            k1, k2 = y1.to(tl.float32), y2.to(tl.float32)
            v1, v2 = x1.to(dtype).to(tl.float32), x2.to(dtype).to(tl.float32)
            if SCALED:  # FP8: value / its head's scale, saturated at the largest e4m3 value
                ks = tl.load(ks_ptr + (h - HQ), mask=is_k, other=1.0)[:, None]
                vs = tl.load(vs_ptr + (h - HEADS), mask=is_v, other=1.0)[:, None]
                # div_rn: IEEE division, as the torch reference divides.
                k1 = tl.clamp(tl.math.div_rn(k1, ks), -448.0, 448.0)
                k2 = tl.clamp(tl.math.div_rn(k2, ks), -448.0, 448.0)
                # no NaN in V pages (worker/model/triton_pages.py): 0, as the torch store writes
                v1, v2 = tl.math.div_rn(v1, vs), tl.math.div_rn(v2, vs)
                v1 = tl.clamp(tl.where(v1 == v1, v1, 0.0), -448.0, 448.0)
                v2 = tl.clamp(tl.where(v2 == v2, v2, 0.0), -448.0, 448.0)
            tl.store(k_at, k1.to(cache), mask=kmask)
            tl.store(k_at + HALF, k2.to(cache), mask=kmask)
            tl.store(v_at, v1.to(cache), mask=vmask)
            tl.store(v_at + HALF * stride_vcd, v2.to(cache), mask=vmask)

    return SimpleNamespace(qk_norm_rope=qk_norm_rope_kernel)


def qk_norm_rope(
    qkv: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    kv_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """In place on qkv [T, (Hq + 2 Hkv) * D] (q heads | k heads | v heads, D = head_dim):
    RMSNorm each q and k head (when q_weight / k_weight [D] are given: Qwen3), then rotate it by
    cos/sin [T, D] float32 (neox rotate-half; the rows' halves must be equal, as
    `RotaryEmbedding.cos_sin` makes them). v is left as it is. With kv_cache = (k_cache,
    v_cache [P, Hkv, page_size, D], slot_mapping [T]) the rotated k and the v of each token also
    go to its cache slot (page * page_size + offset; a negative slot is skipped), as
    attention.store_kv does: one kernel for both jobs. kv_scales = (k_scale, v_scale) [Hkv]
    float32 for FP8 caches (the stored value is divided by its head's scale, saturated)."""
    t = qkv.shape[0]
    head_dim = cos.shape[-1]
    heads = num_q_heads + num_kv_heads
    if qkv.dim() != 2 or qkv.shape[1] != (heads + num_kv_heads) * head_dim or qkv.stride(1) != 1:
        raise ValueError(
            f"qkv must be [T, (Hq + 2*Hkv) * head_dim] with unit column stride; got "
            f"{tuple(qkv.shape)} strides {tuple(qkv.stride())} for Hq={num_q_heads}, "
            f"Hkv={num_kv_heads}, head_dim={head_dim}"
        )
    if head_dim % 2 or cos.shape != (t, head_dim) or sin.shape != (t, head_dim):
        raise ValueError(
            f"cos/sin must be [T={t}, head_dim] with an even head_dim; got {tuple(cos.shape)}, "
            f"{tuple(sin.shape)}"
        )
    if (
        cos.stride(1) != 1
        or sin.stride(1) != 1
        or cos.dtype != torch.float32
        or sin.dtype != torch.float32
    ):
        raise ValueError(
            "cos/sin must be float32 with unit column stride (RotaryEmbedding.cos_sin's output)"
        )
    has_norm = q_weight is not None and k_weight is not None
    if (q_weight is None) != (k_weight is None):
        raise ValueError("qk_norm_rope takes both q_weight and k_weight (Qwen3) or neither")
    if kv_cache is not None:
        k_cache, v_cache, slots = kv_cache
        want = (num_kv_heads, head_dim)
        if (
            (k_cache.shape[1], k_cache.shape[3]) != want
            or v_cache.shape != k_cache.shape
            or slots.shape != (t,)
            or k_cache.stride(3) != 1
            or v_cache.stride(3) not in (1, k_cache.shape[2])
        ):
            raise ValueError(
                f"kv_cache must be k/v caches [P, Hkv={num_kv_heads}, page_size, D={head_dim}] "
                f"(K feature-major, V feature- or token-major) and slots [T={t}]; got "
                f"{tuple(k_cache.shape)}, "
                f"{tuple(v_cache.shape)}, {tuple(slots.shape)}"
            )
    else:  # placeholders the kernel ignores (4-D, for the cache strides)
        k_cache = v_cache = cos[None, None]
        slots = cos
    scaled = kv_cache is not None and kv_scales is not None
    if scaled:
        assert kv_scales is not None
        if any(s.shape != (num_kv_heads,) or s.dtype != torch.float32 for s in kv_scales):
            raise ValueError(
                f"kv_scales must be two float32 [{num_kv_heads}] tensors, got "
                f"{[(tuple(s.shape), s.dtype) for s in kv_scales]}"
            )
    ks, vs = kv_scales if scaled and kv_scales is not None else (cos, cos)
    if t == 0:
        return
    half = head_dim // 2
    block_half = next_pow2(half)
    store_heads = heads + (num_kv_heads if kv_cache is not None else 0)
    block_h = min(next_pow2(store_heads), max(1, _ROPE_TILE // (2 * block_half)))
    if t <= FEW_TOKENS:
        block_h = min(block_h, FEW_TOKENS_HEADS)
    _kernels().qk_norm_rope[(t, -(-store_heads // block_h))](
        qkv,
        cos,
        sin,
        q_weight if has_norm else cos,
        k_weight if has_norm else cos,
        k_cache,
        v_cache,
        slots,
        ks,
        vs,
        qkv.stride(0),
        cos.stride(0),
        sin.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        v_cache.stride(3),
        eps,
        HQ=num_q_heads,
        HEADS=heads,
        HKV=num_kv_heads,
        HALF=half,
        BLOCK_HALF=block_half,
        BLOCK_H=block_h,
        HAS_NORM=has_norm,
        STORE=kv_cache is not None,
        PAGE=k_cache.shape[2] if kv_cache is not None else 1,
        SCALED=scaled,
        num_warps=4,
    )
