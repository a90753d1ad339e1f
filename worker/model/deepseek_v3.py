"""DeepSeek-V3 (`DeepseekV3ForCausalLM`): MLA attention over latent pages, DeepSeek MoE, MTP.

The decoder is the dense family's shape (pre-norm, the residual carried beside each layer's
output and added inside the next norm, as worker/model/llama.py does), with:

- attention: `MLAAttention` (worker/model/mla.py) reading and writing this layer's MLA latent
  pages (`KVCache.latent(layer)`); its backend is the torch reference on CPU and the Triton
  absorbed decode kernel on CUDA (worker/model/triton_mla.py);
- MLP: a dense SwiGLU in the first `first_k_dense_replace` layers, `DeepseekMoE`
  (worker/model/deepseek_moe.py) after;
- MTP: the checkpoint's `num_nextn_predict_layers` multi-token-prediction layers
  (`model.layers.{num_hidden_layers + k}.*`) are loaded into `self.mtp` when present and kept
  for speculative decoding; they are not run yet (nor do they have KV pages). They share the
  main model's embedding and LM head, so the checkpoint's copies of those are not read.

FP8 (DeepSeek's own release: block-scaled e4m3, `ArchConfig.quant`; on CUDA, the CPU
dequantizes everything at load): MLA's q_a/q_b (or q), kv_a_proj_with_mqa and o_proj, the dense
MLPs and the shared experts keep FP8 weights (layers.py's FP8 linears, the GEMM and GEMV of
fp8_gemm.py / gemv.py); kv_b_proj (absorbed per head, mla.py), the routed experts (the MoE
kernels run the model dtype, as for Qwen3-MoE) and the MTP layer's eh_proj are dequantized at
load to the model dtype. Embeddings, lm_head, norms, the router's gate and its
e_score_correction_bias are stored unquantized and load as they are.

Checkpoint names follow transformers (and DeepSeek's own release): self_attn.{q_a_proj,
q_a_layernorm, q_b_proj | q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj},
mlp.{gate, gate.e_score_correction_bias, experts.{e}.*, shared_experts.*}.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import cast

import torch
from torch import nn

from worker.arch.deepseek_config import DeepseekArch
from worker.arch.hf_config import ArchConfig
from worker.batch import ForwardBatch
from worker.kv_cache import KVCache
from worker.model import fused
from worker.model.attention import AttentionBackend
from worker.model.base import CausalLM, WeightSlot
from worker.model.deepseek_moe import DeepseekMoE
from worker.model.layers import ColumnParallelLinear, Embedding, LMHead, RMSNorm, TPInfo
from worker.model.llama import MLP
from worker.model.mla import MLAAttention, MLABackend, TorchMLABackend
from worker.model.moe import MoEParallel
from worker.model.rope import RotaryEmbedding
from worker.model.triton_mla import TritonMLABackend

log = logging.getLogger(__name__)


def mla_backend(device: torch.device | str) -> MLABackend:
    """Triton absorbed decode + decompressed prefill on CUDA (with triton); else the reference."""
    return TritonMLABackend() if fused.available(device) else TorchMLABackend()


class DeepseekDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ArchConfig,
        layer: int,
        tp: TPInfo,
        backend: MLABackend,
        par: MoEParallel,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        ds = cast(DeepseekArch, cfg.family)
        self.self_attn = MLAAttention(
            ds.mla, cfg.hidden_size, cfg.num_heads, layer, cfg.qkv_bias, tp, backend, dtype,
            cfg.quant,
        )
        self.mlp: nn.Module
        moe = cfg.moe
        # An MTP layer (layer >= num_layers) is built like the last decoder layer (MoE in V3).
        if moe is not None and moe.sparse_layers[min(layer, cfg.num_layers - 1)]:
            shared = None
            if ds.n_shared_experts:  # llama's SwiGLU, at the shared experts' width
                shared = MLP(
                    replace(cfg, intermediate_size=moe.intermediate_size * ds.n_shared_experts),
                    tp,
                    dtype,
                )
            self.mlp = DeepseekMoE(
                cfg.hidden_size,
                moe.intermediate_size,
                moe.num_experts,
                moe.top_k,
                moe.norm_topk_prob,
                ds,
                shared,
                par,
                dtype,
            )
        else:
            self.mlp = MLP(cfg, tp, dtype, layer)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As llama's DecoderLayer: (this layer's MLP output, the residual stream before it)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_norm(x, residual)  # [T, hidden] each
        h = self.self_attn(h, cos, sin, batch, cache)
        h, residual = self.post_attention_layernorm.add_norm(h, residual)
        return self.mlp(h), residual

    def slots(self, prefix: str) -> dict[str, WeightSlot]:
        """This layer's checkpoint tensors under `prefix` (model.layers.N)."""
        attn, a = self.self_attn, f"{prefix}.self_attn"
        slots = {
            f"{prefix}.input_layernorm.weight": WeightSlot(self.input_layernorm, "weight"),
            f"{prefix}.post_attention_layernorm.weight": WeightSlot(
                self.post_attention_layernorm, "weight"
            ),
            f"{a}.kv_a_layernorm.weight": WeightSlot(attn.kv_a_layernorm, "weight"),
            f"{a}.kv_b_proj.weight": WeightSlot(attn.kv_b_proj, "weight"),
            f"{a}.o_proj.weight": WeightSlot(attn.o_proj, "weight"),
        }
        params = ["weight", "bias"] if attn.o_proj.bias is not None else ["weight"]
        if attn.o_proj.bias is not None:
            slots[f"{a}.o_proj.bias"] = WeightSlot(attn.o_proj, "bias")
        if attn.qkv_a_proj is not None:  # q_a_proj | kv_a_proj_with_mqa, fused
            assert attn.q_a_layernorm is not None and attn.q_b_proj is not None
            for param in params:
                slots[f"{a}.q_a_proj.{param}"] = WeightSlot(attn.qkv_a_proj, param, 0)
                slots[f"{a}.kv_a_proj_with_mqa.{param}"] = WeightSlot(attn.qkv_a_proj, param, 1)
            slots[f"{a}.q_a_layernorm.weight"] = WeightSlot(attn.q_a_layernorm, "weight")
            slots[f"{a}.q_b_proj.weight"] = WeightSlot(attn.q_b_proj, "weight")
        else:
            assert attn.q_proj is not None and attn.kv_a_proj is not None
            slots[f"{a}.q_proj.weight"] = WeightSlot(attn.q_proj, "weight")
            for param in params:
                slots[f"{a}.kv_a_proj_with_mqa.{param}"] = WeightSlot(attn.kv_a_proj, param)
        slots.update(_mlp_slots(f"{prefix}.mlp", self.mlp))
        return slots


def _swiglu_slots(prefix: str, mlp: MLP) -> dict[str, WeightSlot]:
    return {
        f"{prefix}.gate_proj.weight": WeightSlot(mlp.gate_up_proj, "weight", 0),
        f"{prefix}.up_proj.weight": WeightSlot(mlp.gate_up_proj, "weight", 1),
        f"{prefix}.down_proj.weight": WeightSlot(mlp.down_proj, "weight"),
    }


def _mlp_slots(prefix: str, mlp: nn.Module) -> dict[str, WeightSlot]:
    if isinstance(mlp, MLP):
        return _swiglu_slots(prefix, mlp)
    assert isinstance(mlp, DeepseekMoE)
    slots = {
        f"{prefix}.gate.weight": WeightSlot(mlp, "gate"),
        f"{prefix}.gate.e_score_correction_bias": WeightSlot(mlp, "e_score_correction_bias"),
    }
    for e in mlp.expert_ids():  # with EP, only this rank's experts (the only ones it reads)
        for piece in ("gate", "up", "down"):
            slots[f"{prefix}.experts.{e}.{piece}_proj.weight"] = WeightSlot(
                mlp, "experts", (e, piece)
            )
    if mlp.shared_experts is not None:
        slots.update(_swiglu_slots(f"{prefix}.shared_experts", cast(MLP, mlp.shared_experts)))
    return slots


class MTPLayer(nn.Module):
    """One multi-token-prediction layer: h' = block(eh_proj([enorm(embed(t+1)) | hnorm(h)])),
    then shared_head.norm before the (shared) LM head. Kept for speculative decoding."""

    def __init__(
        self,
        cfg: ArchConfig,
        layer: int,
        tp: TPInfo,
        backend: MLABackend,
        par: MoEParallel,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        # In the model dtype: an FP8 checkpoint's eh_proj is dequantized at load (a bf16 one
        # loads as it is), once per draft step it is not worth a kernel of its own.
        self.eh_proj = ColumnParallelLinear(
            2 * cfg.hidden_size, [cfg.hidden_size], False, TPInfo(), dtype
        )
        self.block = DeepseekDecoderLayer(cfg, layer, tp, backend, par, dtype)
        self.shared_head_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def slots(self, prefix: str) -> dict[str, WeightSlot]:
        slots = self.block.slots(prefix)
        slots[f"{prefix}.enorm.weight"] = WeightSlot(self.enorm, "weight")
        slots[f"{prefix}.hnorm.weight"] = WeightSlot(self.hnorm, "weight")
        slots[f"{prefix}.eh_proj.weight"] = WeightSlot(self.eh_proj, "weight")
        slots[f"{prefix}.shared_head.norm.weight"] = WeightSlot(self.shared_head_norm, "weight")
        return slots


class DeepseekModel(nn.Module):
    def __init__(
        self, cfg: ArchConfig, tp: TPInfo, backend: MLABackend, par: MoEParallel, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, tp)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(cfg, i, tp, backend, par, dtype) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class DeepseekV3ForCausalLM(CausalLM):
    """DeepSeek-V3 over MLA latent pages (KVShape.latent_dim = kv_lora_rank + qk_rope_head_dim)."""

    def __init__(
        self,
        cfg: ArchConfig,
        tp: TPInfo,
        backend: AttentionBackend | None,
        dtype: torch.dtype,
        rope_device: torch.device | str = "cpu",
        moe: MoEParallel | None = None,
    ) -> None:
        super().__init__()
        assert cfg.family is not None, (
            "DeepseekV3ForCausalLM needs deepseek_config.parse_deepseek_v3's config"
        )
        self.cfg, ds = cfg, cfg.family
        mla = mla_backend(rope_device)  # MLA has its own backends; `backend` is for K/V layers
        par = moe or MoEParallel(size=tp.size, rank=tp.rank, group=tp.group)
        self.model = DeepseekModel(cfg, tp, mla, par, dtype)
        self.lm_head = (
            None if cfg.tie_word_embeddings else LMHead(cfg.vocab_size, cfg.hidden_size, dtype, tp)
        )
        self.rope = RotaryEmbedding(
            cfg.rope, ds.mla.qk_rope_head_dim, rope_device
        )  # the rope slice only
        self.mtp = nn.ModuleList(
            MTPLayer(cfg, cfg.num_layers + k, tp, mla, par, dtype) for k in range(ds.num_mtp_layers)
        )

    @property
    def supports_cuda_graphs(self) -> bool:
        return False  # MoE routing picks experts on the host every step (as Qwen3-MoE)

    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        cos, sin = self.rope.batch_cos_sin(batch)  # [T, rope] each
        x = self.model.embed_tokens(batch.input_ids)  # [T, hidden]
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, cos, sin, batch, kv.latent(i))
        assert residual is not None  # a model has layers
        return self.model.norm.add_norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return self.model.embed_tokens.logits(hidden)  # [N, V] float32
        return self.lm_head(hidden)  # [N, V] float32

    def set_fused_kernels(self, enabled: bool) -> None:
        """Norms (+ residual add) and SiLU*mul as Triton kernels on CUDA (worker/model/fused.py)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, MLP, Embedding)):
                module.fused = enabled

    def weight_slots(self) -> dict[str, WeightSlot]:
        slots: dict[str, WeightSlot] = {
            "model.embed_tokens.weight": WeightSlot(self.model.embed_tokens, "weight"),
            "model.norm.weight": WeightSlot(self.model.norm, "weight"),
        }
        if self.lm_head is not None:
            slots["lm_head.weight"] = WeightSlot(self.lm_head, "weight")
        for i, layer in enumerate(self.model.layers):
            slots.update(cast(DeepseekDecoderLayer, layer).slots(f"model.layers.{i}"))
        for k, mtp in enumerate(self.mtp):
            slots.update(cast(MTPLayer, mtp).slots(f"model.layers.{self.cfg.num_layers + k}"))
        return slots

    def drop_unloaded(self, loaded: set[str]) -> None:
        """Keep the MTP layers the checkpoint carries (transformers' save_pretrained writes none,
        though config.json says num_nextn_predict_layers=1); drop the rest."""
        present = 0
        for k in range(len(self.mtp)):
            prefix = f"model.layers.{self.cfg.num_layers + k}."
            if not any(name.startswith(prefix) for name in loaded):
                break
            present += 1
        if present < len(self.mtp):
            log.info(
                "checkpoint has %d of the %d MTP layers config.json declares; keeping %d",
                present,
                len(self.mtp),
                present,
            )
            self.mtp = nn.ModuleList(list(self.mtp)[:present])
