"""The Llama family of dense decoders: Llama, Mistral, Qwen2, Qwen3.

They differ only in knobs that `ArchConfig` carries: Qwen2's q/k/v bias, Qwen3's per-head
q/k RMSNorm, `attention_bias`, `mlp_bias`, tied embeddings, sliding-window layers and the
RoPE variant. Module names follow the HF checkpoints (model.layers.N.self_attn...), with
q/k/v and gate/up fused; `weight_slots` maps the checkpoint names onto the fused pieces.

The residual stream is carried beside each layer's output, as vLLM and SGLang do: a layer
returns (its MLP's output, the residual so far) and the next norm adds them (`add_norm`), so
on CUDA the add is fused into the norm. `set_fused_kernels(True)` (the loader's choice on
CUDA) also runs q/k norm + RoPE and SiLU·mul as single Triton kernels (worker/model/fused.py,
fused_rope.py); the torch code is the reference and the CPU path, with the same sums in the
same order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from worker.arch.hf_config import ArchConfig
from worker.batch import ForwardBatch
from worker.kv_cache import KVCache
from worker.model import fp8, fused, fused_rope, gemv
from worker.model.attention import AttentionBackend, window_attention
from worker.model.base import CausalLM, WeightSlot
from worker.model.fp8_act import Fp8Rows
from worker.model.layers import (
    ColumnParallelLinear,
    Embedding,
    LMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    TPInfo,
    gemv_scales,
    kv_heads_per_rank,
)
from worker.model.rope import RotaryEmbedding, apply_rope


class Attention(nn.Module):
    def __init__(
        self, cfg: ArchConfig, layer: int, tp: TPInfo, backend: AttentionBackend, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.layer = layer
        self.backend = backend
        self.head_dim = cfg.head_dim
        self.num_heads = cfg.num_heads // tp.size  # on this rank
        self.num_kv_heads = kv_heads_per_rank(cfg.num_kv_heads, tp.size)
        self.scale = cfg.head_dim**-0.5
        self.sliding_window = cfg.layer_windows[layer]
        # checkpoint names, for quantization_config's skip list
        p = f"model.layers.{layer}.self_attn."
        qkv_quant = cfg.quant and cfg.quant.for_module(p + "q_proj", p + "k_proj", p + "v_proj")
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.qkv_bias, tp,
                dtype, qkv_quant
        )
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias,
            tp, dtype,
                                        cfg.quant and cfg.quant.for_module(p + "o_proj"))
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        # Attention sinks [Hq on this rank] (float32): GPT-OSS sets them (worker/model/gpt_oss.py).
        self.sinks: nn.Parameter | None = None
        self.fused = False  # one Triton kernel for q/k norm + RoPE (set_fused_kernels)
        # FP8 KV cache: this rank's K and V scales [Hkv_local] (worker/model/fp8.py); the loader
        # sets them from the checkpoint, or to 1.0. Used only when the cache is FP8.
        self.register_buffer("k_scale", torch.ones(self.num_kv_heads), persistent=False)
        self.register_buffer("v_scale", torch.ones(self.num_kv_heads), persistent=False)

    def forward(
        self, x: torch.Tensor | Fp8Rows, cos: torch.Tensor, sin: torch.Tensor,
        batch: ForwardBatch, kv: KVCache,
    ) -> torch.Tensor:  # [T, hidden] → [T, hidden]
        return self.o_proj(self.attend(self.qkv_proj(x), cos, sin, batch, kv))

    def attend(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
        kv: KVCache,
    ) -> torch.Tensor:
        """The q|k|v projection's output [T, q_size + 2 kv_size] → attention output [T, q_size]:
        q/k norm and RoPE, the new K/V into the cache, attention over the pages."""
        t = qkv.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        k_cache, v_cache = kv.layer(self.layer)  # [P, Hkv, S, D] each
        window = (self.sliding_window
                  if self.sliding_window is not None and kv.is_window(self.layer) else None)
        scales = ((cast(torch.Tensor, self.k_scale), cast(torch.Tensor, self.v_scale))
                  if fp8.is_fp8(k_cache) else None)
        # Fused: q/k norm (Qwen3), RoPE and (outside a window's ring of pages) the K/V store in
        # one kernel.
        store = (k_cache, v_cache, batch.slot_mapping) if self.fused and window is None else None
        if self.fused:
            fused_rope.qk_norm_rope(
                qkv, self.num_heads, self.num_kv_heads, cos, sin,
                None if self.q_norm is None else self.q_norm.weight,
                None if self.k_norm is None else self.k_norm.weight,
                self.q_norm.eps if self.q_norm is not None else 0.0, kv_cache=store,
                kv_scales=scales,
            )
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)  # [T, *] views
        q = q.reshape(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.reshape(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.reshape(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if not self.fused:
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)  # Qwen3: normalize each head before RoPE
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if window is not None:  # a ring of the last W tokens
            o = window_attention(q, k, v, k_cache, v_cache, batch, self.scale, window, self.sinks,
                                 kv_scales=scales)
        else:
            o = self.backend.forward(q, k, v, k_cache, v_cache, batch, self.scale,
                                     self.sliding_window, kv_stored=store is not None,
                                     sinks=self.sinks, kv_scales=scales)
        return o.reshape(t, q_size)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, cfg: ArchConfig, tp: TPInfo, dtype: torch.dtype, layer: int = 0) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        p = f"model.layers.{layer}.mlp."  # checkpoint names, for quantization_config's skip list
        quant = cfg.quant and cfg.quant.for_module(p + "gate_proj", p + "up_proj")
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [inter, inter], cfg.mlp_bias, tp,
            dtype, quant)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, cfg.mlp_bias, tp, dtype,
                                           cfg.quant and cfg.quant.for_module(p + "down_proj"))
        self.fused = False  # one Triton kernel for silu(gate) * up (set_fused_kernels)

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:  # [T, hidden] → [T, hidden]
        gate_up = self.gate_up_proj(x)  # [T, 2 * inter_local]: gate | up
        if self.fused:  # an FP8 down projection may take its input quantized by the kernel
            into = self.down_proj.input_rows(gate_up.shape[0], gate_up.dtype, gate_up.device)
            if into is not None:
                return self.down_proj(fused.silu_mul(gate_up, into=into))
            return self.down_proj(fused.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)  # [T, inter_local] each
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ArchConfig, layer: int, tp: TPInfo, backend: AttentionBackend, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer, tp, backend, dtype)
        self.mlp = MLP(cfg, tp, dtype, layer)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
        batch: ForwardBatch, kv: KVCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output (the embeddings at layer 0, where residual is None);
        residual: the stream before it. Returns (this layer's MLP output, the stream before it)."""
        # [T, hidden] each (the normed rows quantized for an FP8 projection's cuBLAS GEMM)
        h, residual = self.input_layernorm.norm_for(self.self_attn.qkv_proj, x, residual)
        o = self.self_attn(h, cos, sin, batch, kv)
        gate_up = self.mlp.gate_up_proj if isinstance(self.mlp, MLP) else None  # MoE: a router
        h, residual = self.post_attention_layernorm.norm_for(gate_up, o, residual)
        return self.mlp(h), residual

    def forward_stream(
        self, stream: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
        kv: KVCache,
    ) -> None:
        """The same layer for one token on CUDA, as four GEMVs (worker/model/gemv.py) that update
        the residual stream [1, hidden] in place: each norm runs inside the GEMV after it, each
        residual add inside the GEMV before it, SiLU·mul inside gate|up."""
        attn, mlp = self.self_attn, self.mlp
        pre, post = self.input_layernorm, self.post_attention_layernorm
        qkv = gemv.gemv(stream, attn.qkv_proj.weight, attn.qkv_proj.bias,
                        norm=(pre.weight, pre.eps),
                        **gemv_scales(attn.qkv_proj))  # FP8 weights: their block scales
        o = attn.attend(qkv, cos, sin, batch, kv)
        gemv.gemv(o, attn.o_proj.weight, attn.o_proj.bias, residual=stream,
                  **gemv_scales(attn.o_proj))
        act = gemv.gemv(stream, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, pair=True,
                        norm=(post.weight, post.eps), **gemv_scales(mlp.gate_up_proj))
        gemv.gemv(act, mlp.down_proj.weight, mlp.down_proj.bias, residual=stream,
                  **gemv_scales(mlp.down_proj))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ArchConfig, tp: TPInfo, backend: AttentionBackend,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp, backend, dtype)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class LlamaForCausalLM(CausalLM):
    """Llama / Mistral / Qwen2 / Qwen3 dense, over the paged KV cache."""

    def __init__(
        self, cfg: ArchConfig, tp: TPInfo, backend: AttentionBackend, dtype: torch.dtype,
        rope_device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg, tp, backend, dtype)
        # Tied: the output projection is the embedding matrix itself (one tensor, not a copy).
        self.lm_head = (None if cfg.tie_word_embeddings
                        else LMHead(cfg.vocab_size, cfg.hidden_size, dtype, tp))
        # plain tensors, not a buffer
        self.rope = RotaryEmbedding(cfg.rope, cfg.head_dim, rope_device)
        self.single_token_gemv = False  # one-token steps run DecoderLayer.forward_stream

    @property
    def supports_cuda_graphs(self) -> bool:
        return self.cfg.rope.rope_type != "dynamic"  # its frequencies depend on each step's lengths

    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        cos, sin = self.rope.batch_cos_sin(batch)  # [T, D] each, shared by layers
        x = self.model.embed_tokens(batch.input_ids)  # [T, hidden]
        if self.single_token_gemv and x.shape[0] == 1:  # x is the residual stream, updated in place
            for layer in self.model.layers:
                cast(DecoderLayer, layer).forward_stream(x, cos, sin, batch, kv)
            return self.model.norm(x)
        residual: torch.Tensor | None = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, cos, sin, batch, kv)
        assert residual is not None  # a model has layers
        return self.model.norm.add_norm(x, residual)[0]

    def set_fused_kernels(self, enabled: bool) -> None:
        """Run norms (+ residual add), q/k norm + RoPE and SiLU·mul as fused Triton kernels
        (worker/model/fused.py; CUDA) and one-token steps as GEMVs with the norms and adds folded
        in (worker/model/gemv.py; one rank, dense MLPs), or all of it as the torch reference.
        Capture CUDA graphs after."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP, Embedding)):
                module.fused = enabled
        one_rank = self.model.embed_tokens.tp.size == 1
        dense = all(isinstance(cast(DecoderLayer, layer).mlp, MLP) for layer in self.model.layers)
        self.single_token_gemv = (enabled and one_rank and dense
                                  and self.cfg.hidden_size <= gemv.MAX_K_ONE_BLOCK)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return self.model.embed_tokens.logits(hidden)  # [N, V] float32
        return self.lm_head(hidden)  # [N, V] float32

    def weight_slots(self) -> dict[str, WeightSlot]:
        slots: dict[str, WeightSlot] = {
            "model.embed_tokens.weight": WeightSlot(self.model.embed_tokens, "weight")}
        slots["model.norm.weight"] = WeightSlot(self.model.norm, "weight")
        if self.lm_head is not None:
            slots["lm_head.weight"] = WeightSlot(self.lm_head, "weight")
        for i, module in enumerate(self.model.layers):
            layer = cast(DecoderLayer, module)
            slots.update(layer_slots(f"model.layers.{i}", layer, self.mlp_slots))
        return slots

    def mlp_slots(self, prefix: str, mlp: nn.Module) -> dict[str, WeightSlot]:
        """One layer's MLP tensors (a subclass with other MLPs, e.g. MoE, overrides this)."""
        return dense_mlp_slots(prefix, mlp)


def dense_mlp_slots(prefix: str, mlp: nn.Module) -> dict[str, WeightSlot]:
    """A SwiGLU MLP's checkpoint tensors under `prefix`.mlp (gate|up fused)."""
    assert isinstance(mlp, MLP)
    params = ["weight", "bias"] if mlp.gate_up_proj.bias is not None else ["weight"]
    slots = {}
    for index, name in enumerate(("gate_proj", "up_proj")):
        for param in params:
            slots[f"{prefix}.mlp.{name}.{param}"] = WeightSlot(mlp.gate_up_proj, param, index)
    for param in params:
        slots[f"{prefix}.mlp.down_proj.{param}"] = WeightSlot(mlp.down_proj, param)
    return slots


def layer_slots(p: str, layer: DecoderLayer,
                mlp_slots: Callable[[str, nn.Module], dict[str, WeightSlot]] = dense_mlp_slots,
                ) -> dict[str, WeightSlot]:
    """One decoder layer's checkpoint tensors under prefix `p` (e.g. model.layers.3; an EAGLE
    head's layers.0 reuses it)."""
    attn = layer.self_attn
    slots: dict[str, WeightSlot] = {}
    params = ["weight", "bias"] if attn.qkv_proj.bias is not None else ["weight"]
    for shard in ("q", "k", "v"):
        for param in params:
            slots[f"{p}.self_attn.{shard}_proj.{param}"] = WeightSlot(attn.qkv_proj, param, shard)
    for param in ["weight", "bias"] if attn.o_proj.bias is not None else ["weight"]:
        slots[f"{p}.self_attn.o_proj.{param}"] = WeightSlot(attn.o_proj, param)
    if attn.q_norm is not None and attn.k_norm is not None:
        slots[f"{p}.self_attn.q_norm.weight"] = WeightSlot(attn.q_norm, "weight")
        slots[f"{p}.self_attn.k_norm.weight"] = WeightSlot(attn.k_norm, "weight")
    slots.update(mlp_slots(p, layer.mlp))
    slots[f"{p}.input_layernorm.weight"] = WeightSlot(layer.input_layernorm, "weight")
    slots[f"{p}.post_attention_layernorm.weight"] = WeightSlot(
        layer.post_attention_layernorm, "weight")
    return slots
