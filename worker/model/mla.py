"""Multi-head latent attention (DeepSeek-V2/V3) over MLA latent pages.

Per token a layer computes (shapes for one TP rank holding Hl = num_heads / tp_size heads):

    q        = q_b_proj(q_a_layernorm(q_a_proj(x)))       [T, Hl, nope + rope]  (or q_proj(x))
    c | k_pe = kv_a_proj_with_mqa(x)                       [T, kv_lora] | [T, rope]
    c        = kv_a_layernorm(c)
    q_pe, k_pe rotated (k_pe is one key shared by every head)
    latent   = c | k_pe                                    [T, kv_lora + rope]  → the KV cache

and attends over the context's latents. Two equal ways to do that:

- decompressed (the CPU reference, transformers' way): kv_b_proj expands each context latent
  into per-head keys k = (W_UK c) | k_pe and values v = W_UV c, then plain attention;
- absorbed (the GPU decode kernel, worker/model/triton_mla.py): W_UK moves onto the query,
  q_lat = q_nope W_UK [Hl, kv_lora], so scores are q_lat·c + q_pe·k_pe straight against the
  latent pages (MQA with one kv "head" of width kv_lora + rope), the weighted sum stays in
  latent space, and W_UV maps it out per head at the end. Nothing per context token is
  expanded, which is what makes MLA decode cheap in memory traffic.

FP8 (a block-scaled checkpoint on CUDA, `quant`): q_a_proj | kv_a_proj_with_mqa (fused), q_b_proj
(or q_proj) and o_proj keep FP8 weights (layers.py's linears, where their rows on a rank are
whole scale blocks); kv_b_proj is always held in the model dtype, dequantized at load, because
the absorbed forms need its matrix per head.

TP: the query heads (q_b_proj / q_proj rows, kv_b_proj rows, o_proj columns) split over the
ranks; q_a_proj, kv_a_proj_with_mqa and their norms are replicated, so every rank computes and
caches the same latent (why heterogeneous TP ships one copy of each page per decode rank).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from worker.arch.deepseek_config import MLAArch
from worker.arch.fp8_config import BlockFp8Config
from worker.batch import ForwardBatch
from worker.model.attention import context_mask
from worker.model.layers import ColumnParallelLinear, RMSNorm, RowParallelLinear, TPInfo

LORA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers' default eps, not rms_norm_eps


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved rope: x [T, H, D] with pairs (x0, x1), (x2, x3), ... each turned by
    one frequency; cos/sin [T, D] (halves duplicated). The output lists the pairs' first
    elements, then their second ones (as transformers does): q and k get the same layout, so
    their dot products are those of the interleaved rotation."""
    xf = x.float()
    half = xf.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]  # [T, 1, D/2]
    x1, x2 = xf[..., 0::2], xf[..., 1::2]  # [T, H, D/2] each
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def apply_rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope: x [T, H, D], cos/sin [T, D] → [T, H, D] in x's dtype."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


def store_latent(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """latent [T, L] → cache [P, S, L] at slots (page * page_size + offset); slot < 0 skipped."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        latent, slot_mapping = latent[keep], slot_mapping[keep]
    page_size = cache.shape[1]
    cache[slot_mapping // page_size, slot_mapping % page_size] = latent.to(cache.dtype)


def gather_latent(cache: torch.Tensor, pages: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One request's context latents: cache [P, S, L], its pages [n] → [seq_len, L]."""
    picked = cache.index_select(0, pages)  # [n, S, L]
    return picked.reshape(-1, picked.shape[-1])[:seq_len]


class MLAAttention(nn.Module):
    """One layer's MLA; `backend` does the cache write and the attention (see module doc)."""

    def __init__(
        self,
        mla: MLAArch,
        hidden: int,
        num_heads: int,
        layer: int,
        bias: bool,
        tp: TPInfo,
        backend: MLABackend,
        dtype: torch.dtype | None = None,
        quant: BlockFp8Config | None = None,
    ) -> None:
        super().__init__()
        if num_heads % tp.size:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be divisible by tp_size ({tp.size})"
            )
        self.mla, self.layer, self.backend = mla, layer, backend
        self.num_heads = num_heads // tp.size  # on this rank
        self.scale = mla.softmax_scale
        q_out = num_heads * mla.qk_head_dim
        kv_a = mla.kv_lora_rank + mla.qk_rope_head_dim
        replicated = TPInfo()  # every rank holds these whole: the latent is the same on each
        p = f"model.layers.{layer}.self_attn."  # checkpoint names, for modules_to_not_convert

        def fp8(*names: str) -> BlockFp8Config | None:
            return quant and quant.for_module(*(p + n for n in names))

        # q_a_proj and kv_a_proj_with_mqa both read x and are replicated: one fused matmul.
        self.qkv_a_proj: ColumnParallelLinear | None = None
        self.q_proj: ColumnParallelLinear | None = None
        self.kv_a_proj: ColumnParallelLinear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: ColumnParallelLinear | None = None
        if mla.q_lora_rank is not None:
            self.qkv_a_proj = ColumnParallelLinear(
                hidden, [mla.q_lora_rank, kv_a], bias, replicated, dtype,
                fp8("q_a_proj", "kv_a_proj_with_mqa"),
            )
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LORA_NORM_EPS, dtype)
            self.q_b_proj = ColumnParallelLinear(
                mla.q_lora_rank, [q_out], False, tp, dtype, fp8("q_b_proj")
            )
        else:
            self.q_proj = ColumnParallelLinear(hidden, [q_out], False, tp, dtype, fp8("q_proj"))
            self.kv_a_proj = ColumnParallelLinear(
                hidden, [kv_a], bias, replicated, dtype, fp8("kv_a_proj_with_mqa")
            )
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LORA_NORM_EPS, dtype)
        # kv_b_proj rows are per head (nope | v): a contiguous block of heads per rank. Never
        # FP8: the absorbed forms view its matrix per head (absorbed_weights), so an FP8
        # checkpoint's kv_b_proj is dequantized at load to the model dtype (quant None here).
        self.kv_b_proj = ColumnParallelLinear(
            mla.kv_lora_rank,
            [num_heads * (mla.qk_nope_head_dim + mla.v_head_dim)],
            False,
            tp,
            dtype,
        )
        self.o_proj = RowParallelLinear(
            num_heads * mla.v_head_dim, hidden, bias, tp, dtype, fp8("o_proj")
        )

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] → q_nope [T, Hl, nope], q_pe [T, Hl, rope] (rotated), latent [T, L]."""
        mla, t = self.mla, x.shape[0]
        if self.qkv_a_proj is not None:
            assert self.q_a_layernorm is not None and self.q_b_proj is not None
            qa, kv = self.qkv_a_proj(x).split([mla.q_lora_rank or 0, mla.latent_dim], dim=-1)
            q = self.q_b_proj(self.q_a_layernorm(qa))  # [T, Hl * qk_head_dim]
        else:
            assert self.q_proj is not None and self.kv_a_proj is not None
            q, kv = self.q_proj(x), self.kv_a_proj(x)
        q_nope, q_pe = q.view(t, self.num_heads, mla.qk_head_dim).split(
            [mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1
        )  # [T, Hl, nope], [T, Hl, rope]
        c, k_pe = kv.split(
            [mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1
        )  # [T, kv_lora], [T, rope]
        rope = apply_rope_interleaved if mla.rope_interleave else apply_rope_half
        q_pe, k_pe = rope(q_pe, cos, sin), rope(k_pe[:, None, :], cos, sin)[:, 0]
        latent = torch.cat([self.kv_a_layernorm(c), k_pe], dim=-1)  # [T, L]
        return q_nope, q_pe, latent

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        cache: torch.Tensor,
    ) -> torch.Tensor:  # x [T, hidden], cache [P, S, L] (this layer's latent pages) → [T, hidden]
        q_nope, q_pe, latent = self.project(x, cos, sin)
        o = self.backend.forward(self, q_nope, q_pe, latent, cache, batch)  # [T, Hl, v]
        return self.o_proj(o.reshape(x.shape[0], self.num_heads * self.mla.v_head_dim))

    # ---- the two forms of kv_b_proj ----------------------------------------------------------
    def decompress(self, ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Context latents [N, kv_lora + rope] → keys [Hl, N, qk_head], values [Hl, N, v]."""
        mla = self.mla
        c, k_pe = ctx.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(c).view(-1, self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim)
        k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)  # [L_ctx, Hl, *]
        k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, self.num_heads, -1)], dim=-1)
        return k.transpose(0, 1), v.transpose(0, 1)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head: W_UK [Hl, nope, kv_lora] and W_UV [Hl, v, kv_lora] (views)."""
        mla = self.mla
        w = self.kv_b_proj.weight.view(
            self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank
        )
        return w[:, : mla.qk_nope_head_dim], w[:, mla.qk_nope_head_dim :]

    def absorb_query(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """q_nope [B, Hl, nope], q_pe [B, Hl, rope] → q in latent space [B, Hl, kv_lora+rope]."""
        w_uk, _ = self.absorbed_weights()
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [B, Hl, kv_lora]
        return torch.cat([q_lat, q_pe.to(q_lat.dtype)], dim=-1)

    def expand_output(self, o_lat: torch.Tensor) -> torch.Tensor:
        """Attention output in latent space [B, Hl, kv_lora] → per head [B, Hl, v] (W_UV)."""
        _, w_uv = self.absorbed_weights()
        return torch.bmm(o_lat.transpose(0, 1).to(w_uv.dtype), w_uv.transpose(1, 2)).transpose(0, 1)


class MLABackend(ABC):
    """The cache write and the attention of an MLA layer; one instance shared by all layers."""

    @abstractmethod
    def forward(
        self,
        attn: MLAAttention,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        cache: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """Store `latent` [T, L] at slot_mapping, attend each token over its request's context:
        q_nope [T, Hl, nope], q_pe [T, Hl, rope] → [T, Hl, v]."""


def prefill_decompressed(
    attn: MLAAttention,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    pages: torch.Tensor,
    seq_len: int,
) -> torch.Tensor:
    """One request's n new tokens over its whole context, through decompressed keys/values:
    q_nope [n, Hl, nope], q_pe [n, Hl, rope] → [n, Hl, v]. Causal within the chunk."""
    n = q_nope.shape[0]
    k, v = attn.decompress(gather_latent(cache, pages, seq_len).to(q_nope.dtype))  # [Hl, L, *]
    q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # [Hl, n, qk_head]
    mask = context_mask(seq_len, n, None, q.device)
    o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=attn.scale)
    return o[0].transpose(0, 1)  # [n, Hl, v]


class TorchMLABackend(MLABackend):
    """The reference (CPU, any device): every request decompresses its context per step, as
    transformers does, and attends with torch SDPA."""

    def forward(
        self,
        attn: MLAAttention,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        cache: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        store_latent(latent, cache, batch.slot_mapping)
        page_size = cache.shape[1]
        out = q_nope.new_empty(q_nope.shape[0], attn.num_heads, attn.mla.v_head_dim)  # [T, Hl, v]
        qs = batch.query_start_list
        for i, seq_len in enumerate(batch.seq_lens_list):
            start, end = qs[i], qs[i + 1]
            if end == start:
                continue
            pages = batch.page_table[i, : -(-seq_len // page_size)]
            out[start:end] = prefill_decompressed(
                attn, q_nope[start:end], q_pe[start:end], cache, pages, seq_len
            )
        return out
