"""GPU MLA: a Triton decode kernel in the absorbed form, decompressed prefill through SDPA.

`TritonMLABackend` plugs in behind `MLABackend` (worker/model/mla.py):

- store: one program per new token writes its latent row into `slot_mapping[t]` of the layer's
  latent pages [P, S, L]; a negative slot is skipped.
- decode (one new token per request): the query moves into latent space on the host side of
  the kernel (q_lat = q_nope W_UK, one batched matmul per layer), then a split-K paged kernel,
  one program per (request, block of 16 query heads, split), scores q_lat·c + q_pe·k_pe straight
  against the latent pages — MQA over one kv "head" of width kv_lora + rope, so each latent
  row is read once per 16 heads — and accumulates the softmax-weighted latents in float32.
  Splits are merged by their log-sum-exp in a second kernel; W_UV maps the result out per
  head (one batched matmul). Reads no host value (CUDA-graph safe).
- prefill / mixed steps: the one-token requests take the decode kernel; each multi-token
  request decompresses its context through kv_b_proj and calls SDPA (as the reference does).

Triton is imported on first use, so this module imports without it; `TRITON_INTERPRET=1` runs
the kernels on CPU tensors (the tests do).
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import torch

from worker.batch import ForwardBatch
from worker.model.fused import next_pow2
from worker.model.mla import MLAAttention, MLABackend, prefill_decompressed
from worker.model.triton_decode import num_decode_splits

BLOCK_H = 16  # query heads per program: tl.dot's smallest tile
BLOCK_N = 32  # context tokens per inner-loop step (a [32, 512] bf16 latent tile is 32 KiB)


@functools.cache
def _kernels(interpret: bool) -> SimpleNamespace:
    """Define the kernels on first use; keyed on TRITON_INTERPRET so CPU and GPU runs of one
    process never share a compiled (or interpreted) kernel."""
    import triton
    import triton.language as tl

    @triton.jit
    def store_latent_kernel(
        x_ptr, c_ptr, slot_ptr, stride_xt, stride_cp, stride_cs,
        L: tl.constexpr, BLOCK: tl.constexpr, PAGE: tl.constexpr,
    ):
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t)
        page = tl.maximum(slot, 0) // PAGE
        off = tl.maximum(slot, 0) % PAGE
        i = tl.arange(0, BLOCK)
        m = i < tl.where(slot >= 0, L, 0)  # slot -1: nothing is written
        x = tl.load(x_ptr + t * stride_xt + i, mask=m)
        at = c_ptr + page * stride_cp + off * stride_cs + i
        tl.store(at, x.to(c_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def decode_kernel(
        q_ptr, c_ptr, pt_ptr, sl_ptr, o_ptr, op_ptr, lse_ptr,
        stride_qb, stride_qh, stride_cp, stride_cs, stride_ptb, stride_ob, stride_oh,
        scale_log2,
        H: tl.constexpr, KV: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    ):
        b = tl.program_id(0)
        hb = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(sl_ptr + b).to(tl.int32)
        per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = split * per_split
        end = tl.minimum(start + per_split, seq_len)

        h = hb * BLOCK_H + tl.arange(0, BLOCK_H)  # this program's query heads
        hm = h < H
        c = tl.arange(0, BLOCK_C)
        cm = c < KV
        r = tl.arange(0, BLOCK_R)
        rm = r < ROPE
        q_row = q_ptr + b * stride_qb + h[:, None] * stride_qh
        q_c = tl.load(q_row + c[None, :], mask=hm[:, None] & cm[None, :], other=0.0)  # [BH, BC]
        q_r = tl.load(q_row + KV + r[None, :], mask=hm[:, None] & rm[None, :], other=0.0)  # [BH,BR]

        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_sum = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            valid = n < end
            page = tl.load(pt_ptr + b * stride_ptb + n // PAGE, mask=valid, other=0).to(tl.int64)
            row = c_ptr + page * stride_cp + (n % PAGE) * stride_cs  # [BN] latent rows
            lat_c = tl.load(row[:, None] + c[None, :], mask=valid[:, None] & cm[None, :], other=0.0)
            rmask = valid[:, None] & rm[None, :]
            lat_r = tl.load(row[:, None] + KV + r[None, :], mask=rmask, other=0.0)  # [BN, BR]
            s = tl.dot(q_c, tl.trans(lat_c), input_precision=PRECISION)  # [BH, BN]
            s += tl.dot(q_r, tl.trans(lat_r), input_precision=PRECISION)
            s = tl.where(valid[None, :], s * scale_log2, float("-inf"))  # log2 domain
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m - m_new)
            l_sum = l_sum * alpha + tl.sum(p, 1)
            pv = tl.dot(p.to(lat_c.dtype), lat_c, input_precision=PRECISION)  # [BH, BC]
            acc = acc * alpha[:, None] + pv
            m = m_new

        has = l_sum > 0
        out = acc / tl.where(has, l_sum, 1.0)[:, None]
        if NUM_SPLITS == 1:
            o_at = o_ptr + b * stride_ob + h[:, None] * stride_oh + c[None, :]
            tl.store(o_at, out.to(o_ptr.dtype.element_ty), mask=hm[:, None] & cm[None, :])
        else:
            # partials: op [B, H, NUM_SPLITS, BLOCK_C] fp32, lse [B, H, NUM_SPLITS] (log2 domain)
            slot = (b * H + h) * NUM_SPLITS + split  # [BH]
            tl.store(op_ptr + slot[:, None] * BLOCK_C + c[None, :], out, mask=hm[:, None])
            lse = tl.where(has, m + tl.log2(tl.where(has, l_sum, 1.0)), float("-inf"))
            tl.store(lse_ptr + slot, lse, mask=hm)

    @triton.jit
    def merge_kernel(
        op_ptr, lse_ptr, o_ptr, stride_ob, stride_oh,
        H: tl.constexpr, KV: tl.constexpr, BLOCK_C: tl.constexpr, NUM_SPLITS: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.arange(0, NUM_SPLITS)
        c = tl.arange(0, BLOCK_C)
        slot = (b * H + h) * NUM_SPLITS + sp  # [NS]
        lse = tl.load(lse_ptr + slot)
        mx = tl.max(lse, 0)
        w = tl.where(lse > float("-inf"), tl.exp2(lse - mx), 0.0)  # [NS]; empty splits weigh 0
        parts = tl.load(op_ptr + slot[:, None] * BLOCK_C + c[None, :])  # [NS, BC]
        den = tl.sum(w, 0)
        out = tl.sum(parts * w[:, None], 0) / tl.where(den > 0, den, 1.0)
        o_at = o_ptr + b * stride_ob + h * stride_oh + c
        tl.store(o_at, out.to(o_ptr.dtype.element_ty), mask=c < KV)

    return SimpleNamespace(store=store_latent_kernel, decode=decode_kernel, merge=merge_kernel)


def _get() -> SimpleNamespace:
    return _kernels(os.environ.get("TRITON_INTERPRET") == "1")


def triton_store_latent(
    latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """latent [T, L] → cache [P, S, L] at slot_mapping [T] (page * page_size + offset); < 0 skip."""
    t, width = latent.shape
    if t == 0:
        return
    assert latent.stride(1) == 1 and cache.stride(2) == 1 and cache.shape[2] == width
    _get().store[(t,)](
        latent, cache, slot_mapping, latent.stride(0), cache.stride(0), cache.stride(1),
        L=width, BLOCK=next_pow2(width), PAGE=cache.shape[1],
    )


def triton_mla_decode(
    q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
    kv_lora_rank: int, scale: float, num_splits: int | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode: q [B, H, kv_lora + rope] (q_nope W_UK | q_pe) over each request's
    latent pages cache [P, S, kv_lora + rope] → the softmax-weighted latents [B, H, kv_lora]
    (q's dtype). page_table [B, max_pages], seq_lens [B] (a row of length 0 gives zeros)."""
    b, h, width = q.shape
    rope = width - kv_lora_rank
    assert cache.shape[2] == width and q.stride(2) == 1 and cache.stride(2) == 1
    out = q.new_empty(b, h, kv_lora_rank)
    if b == 0:
        return out
    head_blocks = -(-h // BLOCK_H)
    splits = num_splits or num_decode_splits(b, head_blocks)
    block_c = max(16, next_pow2(kv_lora_rank))
    if splits > 1:
        partial = torch.empty(b, h, splits, block_c, dtype=torch.float32, device=q.device)
        lse = torch.empty(b, h, splits, dtype=torch.float32, device=q.device)
    else:
        partial = lse = out  # not read by the kernel when NUM_SPLITS == 1
    kern = _get()
    kern.decode[(b, head_blocks, splits)](
        q, cache, page_table, seq_lens, out, partial, lse,
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), page_table.stride(0),
        out.stride(0), out.stride(1),
        scale * 1.4426950408889634,  # log2(e): the kernel works in base 2
        H=h, KV=kv_lora_rank, ROPE=rope, BLOCK_H=BLOCK_H, BLOCK_C=block_c,
        BLOCK_R=max(16, next_pow2(rope)), PAGE=cache.shape[1], BLOCK_N=BLOCK_N, NUM_SPLITS=splits,
        # float32 pools (tests, the CPU-equal engine) keep full precision; tf32 would round them.
        PRECISION="ieee" if cache.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=2,
    )
    if splits > 1:
        kern.merge[(b, h)](partial, lse, out, out.stride(0), out.stride(1),
                           H=h, KV=kv_lora_rank, BLOCK_C=block_c, NUM_SPLITS=splits)
    return out


def mla_decode_absorbed(
    attn: MLAAttention, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
    page_table: torch.Tensor, seq_lens: torch.Tensor,
) -> torch.Tensor:
    """One token per request: q_nope [B, Hl, nope], q_pe [B, Hl, rope] → [B, Hl, v]."""
    q = attn.absorb_query(q_nope, q_pe).to(cache.dtype)  # [B, Hl, kv_lora + rope]
    o_lat = triton_mla_decode(q, cache, page_table, seq_lens, attn.mla.kv_lora_rank, attn.scale)
    return attn.expand_output(o_lat).to(q_nope.dtype)  # [B, Hl, v]


class TritonMLABackend(MLABackend):
    """CUDA: Triton store + absorbed split-K decode; decompressed SDPA for multi-token chunks."""

    def forward(
        self, attn: MLAAttention, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
        cache: torch.Tensor, batch: ForwardBatch,
    ) -> torch.Tensor:
        triton_store_latent(latent, cache, batch.slot_mapping)
        if batch.num_tokens == batch.num_requests:  # pure decode: no host reads
            return mla_decode_absorbed(attn, q_nope, q_pe, cache, batch.page_table, batch.seq_lens)
        qs, lens = batch.query_start_list, batch.seq_lens_list
        page_size = cache.shape[1]
        out = q_nope.new_empty(q_nope.shape[0], attn.num_heads, attn.mla.v_head_dim)  # [T, Hl, v]
        dec = [i for i in range(batch.num_requests) if qs[i + 1] - qs[i] == 1]
        if dec:
            idx = torch.tensor(dec, device=q_nope.device)
            rows = torch.tensor([qs[i] for i in dec], device=q_nope.device)
            out[rows] = mla_decode_absorbed(attn, q_nope[rows], q_pe[rows], cache,
                                            batch.page_table[idx], batch.seq_lens[idx])
        for i in range(batch.num_requests):
            if qs[i + 1] - qs[i] > 1:
                pages = batch.page_table[i, : -(-lens[i] // page_size)]
                out[qs[i] : qs[i + 1]] = prefill_decompressed(
                    attn, q_nope[qs[i] : qs[i + 1]], q_pe[qs[i] : qs[i + 1]], cache, pages, lens[i])
        return out
