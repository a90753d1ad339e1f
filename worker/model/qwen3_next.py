"""Qwen3-Next (`Qwen3NextForCausalLM`): hybrid Gated DeltaNet + gated attention, shared-expert MoE.

A decoder whose token mixer alternates by `layer_types` (config: worker/arch/qwen3_next_config.py):

- linear_attention: Gated DeltaNet (worker/model/gated_deltanet.py), a fixed-size recurrent state
  per request in the KV cache's state region (`state_layers()`, `state_shape()`);
- full_attention: attention over the paged KV with an output gate (q_proj yields q and a gate
  per head; out = o_proj(attn * sigmoid(gate))), q/k RMSNorm, RoPE on the first `rotary_dim`
  dims of each head.

Every norm outside the DeltaNet is zero-centred: y = norm(x) * (1 + w), in float32 then cast
(`OffsetRMSNorm`; transformers initializes w to 0). The MLP is a sparse MoE block (the
Qwen3-MoE router and experts of worker/model/moe.py, TP or EP) plus a shared expert whose
output is scaled by sigmoid(shared_expert_gate(x)); layers in `mlp_only_layers` (or off the
`decoder_sparse_step`) keep a dense SwiGLU MLP. The residual stream is added in the model dtype.
"""

from __future__ import annotations

import dataclasses
from typing import cast

import torch
from torch import nn

from worker.arch.hf_config import ArchConfig
from worker.arch.qwen3_next_config import Qwen3NextArch
from worker.batch import ForwardBatch
from worker.kv_cache import KVCache, StateShape
from worker.model.attention import AttentionBackend
from worker.model.base import CausalLM, WeightSlot
from worker.model.gated_deltanet import GatedDeltaNet
from worker.model.layers import (
    ColumnParallelLinear,
    Embedding,
    LMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    TPInfo,
    kv_heads_per_rank,
)
from worker.model.llama import MLP
from worker.model.moe import MoEParallel, SparseMoEBlock
from worker.model.rope import RotaryEmbedding, apply_rope
from worker.model.weights import TensorSource, WeightShapeError, copy_checked, empty_param


class OffsetRMSNorm(nn.Module):
    """RMSNorm with a zero-centred weight: norm(x) * (1 + w), computed in float32, cast once."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = empty_param(dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)

    def load(self, param: str, source: TensorSource, shard_id: object = None) -> None:
        copy_checked(self.weight.data, source.read(), "OffsetRMSNorm.weight")


class GatedAttention(nn.Module):
    def __init__(
        self, cfg: ArchConfig, layer: int, tp: TPInfo, backend: AttentionBackend, dtype: torch.dtype
    ) -> None:
        super().__init__()
        arch: Qwen3NextArch = cfg.family
        if cfg.num_heads % tp.size:
            raise WeightShapeError(
                f"num_attention_heads ({cfg.num_heads}) must be divisible by tp_size ({tp.size})")
        self.layer, self.backend = layer, backend
        self.head_dim, self.rotary_dim = cfg.head_dim, arch.rotary_dim
        self.num_heads = cfg.num_heads // tp.size
        self.num_kv_heads = kv_heads_per_rank(cfg.num_kv_heads, tp.size)
        # q_proj yields [q_h | gate_h] per head, so "2 * num_heads" heads of head_dim split evenly.
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, 2 * cfg.num_heads,
                                          cfg.num_kv_heads, cfg.qkv_bias, tp, dtype)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias,
                                        tp, dtype)
        self.q_norm = OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
        kv: KVCache,
    ) -> torch.Tensor:  # [T, hidden] → [T, hidden]
        t, d = x.shape[0], self.head_dim
        q_size, kv_size = 2 * self.num_heads * d, self.num_kv_heads * d
        qg, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q, gate = qg.view(t, self.num_heads, 2 * d).split([d, d], dim=-1)  # [T, Hq, D] each
        q = self._rope(self.q_norm(q), cos, sin)  # [T, Hq, D]
        k = self._rope(self.k_norm(k.view(t, self.num_kv_heads, d)), cos, sin)  # [T, Hkv, D]
        v = v.reshape(t, self.num_kv_heads, d)  # [T, Hkv, D]
        k_cache, v_cache = kv.layer(self.layer)  # [P, Hkv, S, D] each
        o = self.backend.forward(q.contiguous(), k.contiguous(), v, k_cache, v_cache, batch,
                                 d**-0.5)  # [T, Hq, D]
        o = o.reshape(t, self.num_heads * d) * torch.sigmoid(gate.reshape(t, -1))  # the output gate
        return self.o_proj(o)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate the first rotary_dim dims of each head [T, H, D]; the rest pass through."""
        if self.rotary_dim == self.head_dim:
            return apply_rope(x, cos, sin)
        rot, rest = x.split([self.rotary_dim, self.head_dim - self.rotary_dim], dim=-1)
        return torch.cat([apply_rope(rot, cos, sin), rest], dim=-1)


class SharedExpertMoE(nn.Module):
    """Routed experts (SparseMoEBlock: TP or EP) plus the shared expert, scaled by
    sigmoid(shared_expert_gate(x))."""

    def __init__(self, cfg: ArchConfig, tp: TPInfo, par: MoEParallel, dtype: torch.dtype) -> None:
        super().__init__()
        moe, arch = cfg.moe, cfg.family
        assert moe is not None
        self.experts = SparseMoEBlock(cfg.hidden_size, moe.intermediate_size, moe.num_experts,
                                      moe.top_k, moe.norm_topk_prob, par, dtype)
        shared = dataclasses.replace(
            cfg, intermediate_size=arch.shared_expert_intermediate_size, mlp_bias=False)
        self.shared_expert = MLP(shared, tp, dtype)  # column/row parallel over attention TP
        # [1, hidden], the same on every rank (a TPInfo of one rank: nothing split)
        self.shared_expert_gate = ColumnParallelLinear(cfg.hidden_size, [1], False, TPInfo(), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] → [T, hidden]
        gate = torch.sigmoid(self.shared_expert_gate(x))  # [T, 1]
        return self.experts(x) + gate * self.shared_expert(x)


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ArchConfig, layer: int, tp: TPInfo, backend: AttentionBackend,
        dtype: torch.dtype, moe: MoEParallel,
    ) -> None:
        super().__init__()
        arch: Qwen3NextArch = cfg.family
        self.linear_attn: GatedDeltaNet | None = None
        self.self_attn: GatedAttention | None = None
        # An MTP layer (layer >= num_layers) is full attention, its MLP built like the last one.
        if layer < cfg.num_layers and arch.linear_layers[layer]:
            self.linear_attn = GatedDeltaNet(cfg.hidden_size, arch, layer, cfg.rms_norm_eps, tp,
                                             dtype)
        else:
            self.self_attn = GatedAttention(cfg, layer, tp, backend, dtype)
        sparse = cfg.moe is not None and cfg.moe.sparse_layers[min(layer, cfg.num_layers - 1)]
        self.mlp: nn.Module = (SharedExpertMoE(cfg, tp, moe, dtype) if sparse
                               else MLP(cfg, tp, dtype))
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
        kv: KVCache,
    ) -> torch.Tensor:  # the residual stream [T, hidden] → the next one
        h = self.input_layernorm(x)
        if self.linear_attn is not None:
            h = self.linear_attn(h, batch, kv)
        else:
            assert self.self_attn is not None
            h = self.self_attn(h, cos, sin, batch, kv)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3NextMTP(nn.Module):
    """The checkpoint's multi-token-prediction layer (`mtp.*`), for speculative.method=mtp:
    norm(layer(fc([norm_e(embed(x_{p+1})) | norm_h(h_p)]))), a gated-attention MoE layer whose
    KV is KV-cache layer num_layers; the logits are the model's LM head of it. Shares the
    model's embedding and LM head."""

    def __init__(self, cfg: ArchConfig, tp: TPInfo, backend: AttentionBackend,
                 dtype: torch.dtype, moe: MoEParallel) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.pre_fc_norm_embedding = OffsetRMSNorm(h, eps, dtype)
        self.pre_fc_norm_hidden = OffsetRMSNorm(h, eps, dtype)
        self.fc = ColumnParallelLinear(2 * h, [h], False, TPInfo(), dtype)  # replicated
        self.layers = nn.ModuleList([DecoderLayer(cfg, cfg.num_layers, tp, backend, dtype, moe)])
        self.norm = OffsetRMSNorm(h, eps, dtype)

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """emb, hidden [T, H] → the feature [T, H] (the next draft step's hidden input)."""
        x = torch.cat([self.pre_fc_norm_embedding(emb),
                       self.pre_fc_norm_hidden(hidden.to(emb.dtype))], dim=-1)  # [T, 2H]
        return self.norm(self.layers[0](self.fc(x), cos, sin, batch, kv))

    def slots(self, p: str = "mtp") -> dict[str, WeightSlot]:
        slots = {f"{p}.fc.weight": WeightSlot(self.fc, "weight"),
                 f"{p}.norm.weight": WeightSlot(self.norm, "weight"),
                 f"{p}.pre_fc_norm_embedding.weight": WeightSlot(self.pre_fc_norm_embedding,
                                                                 "weight"),
                 f"{p}.pre_fc_norm_hidden.weight": WeightSlot(self.pre_fc_norm_hidden, "weight")}
        slots.update(_layer_slots(f"{p}.layers.0", cast(DecoderLayer, self.layers[0])))
        return slots


class Qwen3NextModel(nn.Module):
    def __init__(
        self, cfg: ArchConfig, tp: TPInfo, backend: AttentionBackend, dtype: torch.dtype,
        moe: MoEParallel,
    ) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, tp, backend, dtype, moe) for i in range(cfg.num_layers))
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class Qwen3NextForCausalLM(CausalLM):
    def __init__(
        self, cfg: ArchConfig, tp: TPInfo, backend: AttentionBackend, dtype: torch.dtype,
        rope_device: torch.device | str = "cpu", moe: MoEParallel | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(cfg.family, Qwen3NextArch):
            raise ValueError("Qwen3NextForCausalLM needs the config parsed by "
                             "worker.arch.qwen3_next_config.parse_qwen3_next_config")
        self.cfg, self.arch, self.dtype = cfg, cfg.family, dtype
        par = moe or MoEParallel(size=tp.size, rank=tp.rank, group=tp.group)
        self.model = Qwen3NextModel(cfg, tp, backend, dtype, par)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else LMHead(cfg.vocab_size, cfg.hidden_size, dtype, tp))
        self.rope = RotaryEmbedding(cfg.rope, self.arch.rotary_dim, rope_device)
        # Kept for speculative decoding (worker/spec/heads.py) when the checkpoint has it.
        self.mtp: Qwen3NextMTP | None = (Qwen3NextMTP(cfg, tp, backend, dtype, par)
                                         if self.arch.num_mtp_layers else None)

    @property
    def supports_cuda_graphs(self) -> bool:
        return False  # MoE routing on the host; state slots are not among the graphs' fields

    def state_layers(self) -> tuple[int, ...]:
        return self.arch.state_layers

    def state_shape(self) -> StateShape | None:
        layers = self.arch.state_layers
        if not layers:
            return None
        first = self.model.layers[layers[0]].linear_attn
        assert isinstance(first, GatedDeltaNet)
        return first.state_shape(self.dtype)

    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        cos, sin = self.rope.batch_cos_sin(batch)  # [T, rotary_dim] each
        x = self.model.embed_tokens(batch.input_ids)  # [T, hidden]
        for layer in self.model.layers:
            x = layer(x, cos, sin, batch, kv)
        return self.model.norm(x)  # [T, hidden]

    def commit_verified(self, kv: KVCache, accepted: dict[int, int]) -> None:
        for layer in self.model.layers:
            deltanet = cast(DecoderLayer, layer).linear_attn
            if deltanet is not None:
                deltanet.commit(kv, accepted)

    def set_fused_kernels(self, enabled: bool) -> None:
        """CUDA: the DeltaNet's conv and delta rule as Triton kernels, SiLU·mul fused in the
        dense MLPs. The zero-centred norms and the attention gate stay torch ops."""
        for module in self.modules():
            if isinstance(module, (GatedDeltaNet, MLP, RMSNorm)):
                module.fused = enabled

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return self.model.embed_tokens.logits(hidden)  # [N, V] float32
        return self.lm_head(hidden)  # [N, V] float32

    def weight_slots(self) -> dict[str, WeightSlot]:
        slots = {"model.embed_tokens.weight": WeightSlot(self.model.embed_tokens, "weight"),
                 "model.norm.weight": WeightSlot(self.model.norm, "weight")}
        if self.lm_head is not None:
            slots["lm_head.weight"] = WeightSlot(self.lm_head, "weight")
        for i, module in enumerate(self.model.layers):
            slots.update(_layer_slots(f"model.layers.{i}", cast(DecoderLayer, module)))
        if self.mtp is not None:
            slots.update(self.mtp.slots())
        return slots

    def drop_unloaded(self, loaded: set[str]) -> None:
        """Keep the MTP layer only when the checkpoint carries it (config.json may declare
        mtp_num_hidden_layers for a checkpoint saved without it)."""
        if self.mtp is not None and not any(n.startswith("mtp.") for n in loaded):
            self.mtp = None


def _layer_slots(p: str, module: DecoderLayer) -> dict[str, WeightSlot]:
    slots = {f"{p}.input_layernorm.weight": WeightSlot(module.input_layernorm, "weight"),
             f"{p}.post_attention_layernorm.weight": WeightSlot(module.post_attention_layernorm,
                                                                "weight")}
    if module.linear_attn is not None:
        slots.update(_deltanet_slots(f"{p}.linear_attn", module.linear_attn))
    if module.self_attn is not None:
        slots.update(_attention_slots(f"{p}.self_attn", module.self_attn))
    if isinstance(module.mlp, SharedExpertMoE):
        slots.update(_moe_slots(f"{p}.mlp", module.mlp))
    else:
        slots.update(_mlp_slots(f"{p}.mlp", module.mlp))
    return slots


def _deltanet_slots(p: str, m: GatedDeltaNet) -> dict[str, WeightSlot]:
    return {
        f"{p}.in_proj_qkvz.weight": WeightSlot(m.in_proj_qkvz, "weight"),
        f"{p}.in_proj_ba.weight": WeightSlot(m.in_proj_ba, "weight"),
        f"{p}.conv1d.weight": WeightSlot(m.heads, "conv"),
        f"{p}.A_log": WeightSlot(m.heads, "A_log"),
        f"{p}.dt_bias": WeightSlot(m.heads, "dt_bias"),
        f"{p}.norm.weight": WeightSlot(m.norm, "weight"),
        f"{p}.out_proj.weight": WeightSlot(m.out_proj, "weight"),
    }


def _attention_slots(p: str, m: GatedAttention) -> dict[str, WeightSlot]:
    params = ["weight", "bias"] if m.qkv_proj.bias is not None else ["weight"]
    slots = {f"{p}.{s}_proj.{param}": WeightSlot(m.qkv_proj, param, s)
             for s in ("q", "k", "v") for param in params}
    for param in ["weight", "bias"] if m.o_proj.bias is not None else ["weight"]:
        slots[f"{p}.o_proj.{param}"] = WeightSlot(m.o_proj, param)
    slots[f"{p}.q_norm.weight"] = WeightSlot(m.q_norm, "weight")
    slots[f"{p}.k_norm.weight"] = WeightSlot(m.k_norm, "weight")
    return slots


def _mlp_slots(p: str, mlp: nn.Module) -> dict[str, WeightSlot]:
    assert isinstance(mlp, MLP)
    return {f"{p}.gate_proj.weight": WeightSlot(mlp.gate_up_proj, "weight", 0),
            f"{p}.up_proj.weight": WeightSlot(mlp.gate_up_proj, "weight", 1),
            f"{p}.down_proj.weight": WeightSlot(mlp.down_proj, "weight")}


def _moe_slots(p: str, mlp: SharedExpertMoE) -> dict[str, WeightSlot]:
    experts = mlp.experts
    slots = {f"{p}.gate.weight": WeightSlot(experts, "gate"),
             f"{p}.shared_expert_gate.weight": WeightSlot(mlp.shared_expert_gate, "weight")}
    slots.update(_mlp_slots(f"{p}.shared_expert", mlp.shared_expert))
    for e in experts.expert_ids():  # with EP, only this rank's experts
        for piece in ("gate", "up", "down"):
            name = f"{p}.experts.{e}.{piece}_proj.weight"
            slots[name] = WeightSlot(experts, "experts", (e, piece))
    return slots
