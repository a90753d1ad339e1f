"""Fused Triton kernels for the decoder's elementwise work between its matmuls (CUDA).

In plain torch each of these jobs is several kernels — casts to float32, pow, mean, rsqrt,
multiplies, a cat for rotate-half — and at decode batch 1 those small kernels cost as much GPU
time as the weight matmuls they sit between. Here each job is one kernel:

- `rms_norm(x, weight, eps)`: RMSNorm of each row.
- `add_rms_norm(x, residual, weight, eps)`: the residual add fused into the next norm (as vLLM
  and SGLang do): returns (norm(residual + x), residual + x) from one read of each input.
- `silu_mul(gate_up)`: SwiGLU's silu(gate) * up from the fused gate|up projection.
- `qk_norm_rope(qkv, ...)`: in place on the q|k|v projection output, for every q and k head:
  Qwen3's per-head RMSNorm (when weights are given), then neox (rotate-half) RoPE from the
  step's cos/sin — so every RoPE variant of worker/model/rope.py (default, linear, llama3,
  yarn, dynamic) takes this path, as all of them end in the same cos/sin table. Given the
  layer's caches and slots (`kv_cache=`), it also writes the new k and v to their slots, so
  the attention backend's store kernel is skipped. FP8 caches (`kv_scales=`): each value is
  divided by its head's scale and saturated at ±448 before the e4m3 store, as
  attention.store_kv does.

Numerics follow the torch reference step by step (layers.py `RMSNorm`, rope.py `apply_rope`,
llama.py `MLP`): float32 math, rounded to the model dtype wherever the reference rounds (the
sum before the norm, the normalized row before the weight multiply, silu before the up
multiply), so a fused model's greedy tokens match the unfused one's. The torch code stays the
CPU reference; `available(device)` says where these kernels run. The kernels take any tensor
Triton can address, so `TRITON_INTERPRET=1` runs them on CPU tensors for debugging.
"""

from __future__ import annotations

import functools
import importlib.util
from types import SimpleNamespace

import torch

_NORM_MAX_BLOCK = 1 << 16  # widest row one norm program holds in registers (hidden sizes are ≤ 16k)
_SILU_BLOCK = 1024  # features per silu_mul program
_ROPE_TILE = 1024  # elements of q/k heads per qk_norm_rope program (8 heads of 128)


def available(device: torch.device | str) -> bool:
    """Whether the fused kernels can run on `device`: CUDA with triton importable."""
    return torch.device(device).type == "cuda" and importlib.util.find_spec("triton") is not None


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _kernels() -> SimpleNamespace:
    """Compile-on-first-use: triton is imported only when a fused kernel first runs."""
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_kernel(
        x_ptr,
        r_ptr,
        w_ptr,
        out_ptr,
        res_out_ptr,
        stride_x,
        stride_r,
        stride_out,
        stride_res,
        eps,
        H: tl.constexpr,
        BLOCK: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        dtype = out_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
            x = (r + x).to(dtype)  # the reference adds in the model dtype
            tl.store(res_out_ptr + row * stride_res + cols, x, mask=mask)
            x = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, 0) / H + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = (x * rstd).to(dtype).to(tl.float32)  # normalized, rounded, then times the weight
        tl.store(out_ptr + row * stride_out + cols, (w * y).to(dtype), mask=mask)

    @triton.jit
    def silu_mul_kernel(
        gu_ptr,
        out_ptr,
        stride_gu,
        stride_out,
        INTER: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < INTER
        dtype = out_ptr.dtype.element_ty
        gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gu_ptr + row * stride_gu + INTER + cols, mask=mask, other=0.0).to(tl.float32)
        act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)  # F.silu's output, rounded
        tl.store(out_ptr + row * stride_out + cols, (act * up).to(dtype), mask=mask)

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
                + i[None, :]
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
                v1 = tl.clamp(tl.math.div_rn(v1, vs), -448.0, 448.0)
                v2 = tl.clamp(tl.math.div_rn(v2, vs), -448.0, 448.0)
            tl.store(k_at, k1.to(cache), mask=kmask)
            tl.store(k_at + HALF, k2.to(cache), mask=kmask)
            tl.store(v_at, v1.to(cache), mask=vmask)
            tl.store(v_at + HALF, v2.to(cache), mask=vmask)

    return SimpleNamespace(
        rms_norm=rms_norm_kernel, silu_mul=silu_mul_kernel, qk_norm_rope=qk_norm_rope_kernel
    )


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """x [..., H] as a 2-D [N, H] view with unit stride along H (copies only if it must)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        raise ValueError(
            f"{name}: the last dimension must have stride 1, got strides {tuple(x.stride())}"
        )
    return x2


def _output(
    like: torch.Tensor, shape: tuple[int, ...], out: torch.Tensor | None, name: str
) -> torch.Tensor:
    """A caller's output tensor (checked) or a new one: [N, W] rows with unit column stride."""
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if (
        tuple(out.shape) != shape
        or out.dtype != like.dtype
        or out.device != like.device
        or out.stride(-1) != 1
    ):
        raise ValueError(
            f"{name} must be {shape} {like.dtype} on {like.device} with unit column stride; "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}, strides {tuple(out.stride())}"
        )
    return out


def _norm_launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None,
    residual_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(
            f"RMSNorm weight has shape {tuple(weight.shape)}, x's rows have {hidden} features"
        )
    block = next_pow2(hidden)
    if block > _NORM_MAX_BLOCK:
        raise ValueError(
            f"fused RMSNorm holds rows of up to {_NORM_MAX_BLOCK} features, got {hidden}; "
            "run the model unfused (set_fused_kernels(False))"
        )
    x2 = _rows(x, "x")  # [N, H]
    out2 = _output(x2, tuple(x2.shape), None if out is None else _rows(out, "out"), "out")
    r2 = res2 = out2  # placeholders the kernel ignores without a residual
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"residual {tuple(residual.shape)} {residual.dtype} must match x "
                f"{tuple(x.shape)} {x.dtype}"
            )
        r2 = _rows(residual, "residual")
        res_given = None if residual_out is None else _rows(residual_out, "residual_out")
        res2 = _output(x2, tuple(x2.shape), res_given, "residual_out")
    if x2.shape[0]:
        _kernels().rms_norm[(x2.shape[0],)](
            x2,
            r2,
            weight,
            out2,
            res2,
            x2.stride(0),
            r2.stride(0),
            out2.stride(0),
            res2.stride(0),
            eps,
            H=hidden,
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            num_warps=min(16, max(1, block // 512)),
        )
    return out2.view(x.shape), res2.view(x.shape)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., H] → RMSNorm(x) * weight in x's dtype (float32 statistics), into `out` if given."""
    return _norm_launch(x, None, weight, eps, out, None)[0]


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., H] → (RMSNorm(residual + x) * weight, residual + x), both in x's dtype."""
    return _norm_launch(x, residual, weight, eps, out, residual_out)


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [T, 2I] (gate first, then up) → silu(gate) * up [T, I] in gate_up's dtype."""
    t, width = gate_up.shape
    if width % 2:
        raise ValueError(f"silu_mul needs the fused gate|up output (an even width), got {width}")
    inter = width // 2
    gu = _rows(gate_up, "gate_up")
    out = _output(gate_up, (t, inter), out, "out")  # [T, I]
    if t:
        block = min(_SILU_BLOCK, next_pow2(inter))
        _kernels().silu_mul[(t, _cdiv(inter, block))](
            gu,
            out,
            gu.stride(0),
            out.stride(0),
            INTER=inter,
            BLOCK=block,
            num_warps=4,
        )
    return out


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
            or v_cache.stride(3) != 1
        ):
            raise ValueError(
                f"kv_cache must be k/v caches [P, Hkv={num_kv_heads}, page_size, D={head_dim}] "
                f"with unit last stride and slots [T={t}]; got {tuple(k_cache.shape)}, "
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
    _kernels().qk_norm_rope[(t, _cdiv(store_heads, block_h))](
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
