"""The model drafters' networks (speculative.method draft | eagle | mtp) over the target's pages.

A head's layers keep their KV in the target's pages, as the KV cache's last layers
(`KVShape.draft_layers`): it runs on the very ForwardBatch fields the target uses (page table,
slot mapping), so the scheduler's page table, the prefix cache and PD's page writes cover its KV
as they cover the target's.

What a head computes at position p, and what `feature` (its output) feeds:

- `EagleHead` (eagle): fc([embed(x_{p+1}) | h_p]) through one decoder layer of the target's
  family, then a norm: a feature that predicts the target's h_{p+1}; logits = the target's LM
  head of it. h_p is the target's final hidden state (after its norm) on the catch-up, and the
  head's own previous feature on the draft steps after the first (feature extrapolation).
- mtp: the same shape with the checkpoint's own MTP layer (`DeepseekMTPHead`: eh_proj([enorm(
  embed) | hnorm(h)]) through a decoder block, logits after shared_head.norm;
  `Qwen3NextMTPHead`: fc([norm(embed) | norm(h)]), a gated-attention layer, mtp.norm), or, for
  a dense target without one, an MTP module in DeepSeek's layout trained beside it
  (`DenseMTPHead`).
- `DraftLM` (draft): a small LM of its own over x_p (no hidden state), with the target's
  tokenizer and KV head geometry.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from worker.arch.hf_config import ArchConfig
from worker.batch import ForwardBatch
from worker.kv_cache import KVCache
from worker.model.attention import AttentionBackend
from worker.model.base import CausalLM, WeightSlot
from worker.model.deepseek_v3 import DeepseekV3ForCausalLM, MTPLayer
from worker.model.layers import ColumnParallelLinear, Embedding, RMSNorm, TPInfo
from worker.model.llama import Attention, DecoderLayer, LlamaForCausalLM, layer_slots
from worker.model.qwen3_next import Qwen3NextForCausalLM, Qwen3NextMTP
from worker.model.rope import RotaryEmbedding


@dataclass(frozen=True)
class TargetParts:
    """What a head borrows from the target: its embedding, rope and LM head (shared weights,
    not copies; kept outside the head's modules so they are loaded and counted once)."""

    embed: Embedding
    rope: RotaryEmbedding
    logits: Callable[[torch.Tensor], torch.Tensor]  # hidden [N, H] → [N, V] float32
    dynamic_rope: bool = False  # its frequencies depend on each request's length


def target_parts(target: CausalLM) -> TargetParts:
    """Every family keeps `model.embed_tokens`, `rope` and `cfg` (its ArchConfig)."""
    embed = cast(Embedding, getattr(target, "model").embed_tokens)  # noqa: B009
    cfg = cast(ArchConfig, getattr(target, "cfg"))  # noqa: B009
    rope = cast(RotaryEmbedding, getattr(target, "rope"))  # noqa: B009
    return TargetParts(embed, rope, target.compute_logits, cfg.rope.rope_type == "dynamic")


def rope_of(parts: TargetParts, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, rope dim] for the batch's positions, as the target computes them."""
    lens = None
    if parts.dynamic_rope:
        counts = batch.query_start[1:] - batch.query_start[:-1]  # [B]
        lens = torch.repeat_interleave(batch.seq_lens, counts)  # [T]
    return parts.rope.cos_sin(batch.positions, lens)


class DraftHead(nn.Module, ABC):
    """A drafter network over the target's pages."""

    num_layers: int  # KV layers it keeps (after the target's)
    needs_hidden: bool  # fed the target's hidden state (eagle, mtp): input at p is x_{p+1}

    @abstractmethod
    def forward(self, batch: ForwardBatch, kv: KVCache,
                hidden: torch.Tensor | None) -> torch.Tensor:
        """batch's tokens (and hidden [T, H] when needs_hidden) → features [T, H]; writes the
        head's KV at batch.slot_mapping."""

    @abstractmethod
    def compute_logits(self, feature: torch.Tensor) -> torch.Tensor:
        """features [N, H] → logits [N, V] float32."""

    def weight_slots(self) -> dict[str, WeightSlot]:
        """The head checkpoint's tensor names (heads inside the target checkpoint have none)."""
        return {}

    def graph_safe(self) -> bool:
        """Whether a single-token step reads no host value, so it can be captured in a CUDA
        graph (worker/spec/draft_graphs.py)."""
        return False


class EagleHead(DraftHead):
    """EAGLE: one decoder layer of the target's family over fc([embed(x_{p+1}) | h_p])."""

    needs_hidden = True

    def __init__(self, cfg: ArchConfig, parts: TargetParts, first_layer: int, tp: TPInfo,
                 backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_layers = 1
        self.parts = parts
        h = cfg.hidden_size
        # Replicated on every rank (as DeepSeek's eh_proj): it is small, and its input (the
        # embedding and the hidden state) is replicated anyway.
        self.fc = ColumnParallelLinear(2 * h, [h], False, TPInfo(), dtype)
        # Its KV is KV-cache layer `first_layer` (the one after the target's last).
        self.layers = nn.ModuleList([DecoderLayer(_as_layer(cfg, first_layer), first_layer, tp,
                                                  backend, dtype)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype)

    def forward(self, batch: ForwardBatch, kv: KVCache,
                hidden: torch.Tensor | None) -> torch.Tensor:
        assert hidden is not None, "an EAGLE head is fed the target's hidden states"
        cos, sin = rope_of(self.parts, batch)  # [T, D] each
        emb = self.parts.embed(batch.input_ids)  # [T, H]
        x = self.fc(torch.cat([emb, hidden.to(emb.dtype)], dim=-1))  # [T, 2H] → [T, H]
        out, residual = self.layers[0](x, None, cos, sin, batch, kv)
        return self.norm.add_norm(out, residual)[0]  # [T, H]

    def compute_logits(self, feature: torch.Tensor) -> torch.Tensor:
        return self.parts.logits(feature)

    def graph_safe(self) -> bool:
        return not self.parts.dynamic_rope  # a dynamic rope reads each request's length

    def weight_slots(self) -> dict[str, WeightSlot]:
        slots = layer_slots("layers.0", cast(DecoderLayer, self.layers[0]))
        slots["fc.weight"] = WeightSlot(self.fc, "weight")
        slots["norm.weight"] = WeightSlot(self.norm, "weight")
        return slots


class DenseMTPHead(EagleHead):
    """An MTP module in DeepSeek-V3's layout for a dense target without one of its own (trained
    beside it: models/train_eagle.py --layout mtp): block(eh_proj([enorm(embed(x_{p+1})) |
    hnorm(h_p)])) with a decoder layer of the target's family; the feature is the block's
    output before `shared_head.norm`, which the logits (the target's LM head) read."""

    def __init__(self, cfg: ArchConfig, parts: TargetParts, first_layer: int, tp: TPInfo,
                 backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__(cfg, parts, first_layer, tp, backend, dtype)
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        # self.fc is eh_proj and self.norm is shared_head.norm (names in weight_slots)

    def forward(self, batch: ForwardBatch, kv: KVCache,
                hidden: torch.Tensor | None) -> torch.Tensor:
        assert hidden is not None, "an MTP module is fed the target's hidden states"
        cos, sin = rope_of(self.parts, batch)  # [T, D] each
        emb = self.enorm(self.parts.embed(batch.input_ids))  # [T, H]
        x = self.fc(torch.cat([emb, self.hnorm(hidden.to(emb.dtype))], dim=-1))  # [T, H]
        out, residual = self.layers[0](x, None, cos, sin, batch, kv)
        return out + residual  # [T, H]: before shared_head.norm

    def compute_logits(self, feature: torch.Tensor) -> torch.Tensor:
        return self.parts.logits(self.norm(feature))

    def weight_slots(self) -> dict[str, WeightSlot]:
        slots = layer_slots("layers.0", cast(DecoderLayer, self.layers[0]))
        slots["eh_proj.weight"] = WeightSlot(self.fc, "weight")
        slots["enorm.weight"] = WeightSlot(self.enorm, "weight")
        slots["hnorm.weight"] = WeightSlot(self.hnorm, "weight")
        slots["shared_head.norm.weight"] = WeightSlot(self.norm, "weight")
        return slots


def _as_layer(cfg: ArchConfig, layer: int) -> ArchConfig:
    """The head's config, with a window entry for its layer index (full attention)."""
    windows = tuple(cfg.layer_windows) + (None,) * (layer + 1 - len(cfg.layer_windows))
    return dataclasses.replace(cfg, layer_windows=windows)


class DeepseekMTPHead(DraftHead):
    """DeepSeek-V3's first MTP layer (`DeepseekV3ForCausalLM.mtp[0]`, KV layer num_layers)."""

    needs_hidden = True

    def __init__(self, target: DeepseekV3ForCausalLM) -> None:
        super().__init__()
        self.num_layers = 1
        self.parts = target_parts(target)
        self.layer_index = target.cfg.num_layers
        self.mtp = [cast(MTPLayer, target.mtp[0])]  # the target's module: not registered twice

    def forward(self, batch: ForwardBatch, kv: KVCache,
                hidden: torch.Tensor | None) -> torch.Tensor:
        assert hidden is not None, "an MTP layer is fed the target's hidden states"
        mtp = self.mtp[0]
        cos, sin = rope_of(self.parts, batch)
        emb = mtp.enorm(self.parts.embed(batch.input_ids))  # [T, H]
        x = mtp.eh_proj(torch.cat([emb, mtp.hnorm(hidden.to(emb.dtype))], dim=-1))  # [T, H]
        out, residual = mtp.block(x, None, cos, sin, batch, kv.latent(self.layer_index))
        return out + residual  # [T, H]: before shared_head.norm, the next step's input

    def compute_logits(self, feature: torch.Tensor) -> torch.Tensor:
        return self.parts.logits(self.mtp[0].shared_head_norm(feature))


class Qwen3NextMTPHead(DraftHead):
    """Qwen3-Next's MTP layer (`Qwen3NextForCausalLM.mtp`, KV layer num_layers)."""

    needs_hidden = True

    def __init__(self, target: Qwen3NextForCausalLM) -> None:
        super().__init__()
        assert target.mtp is not None
        self.num_layers = 1
        self.parts = target_parts(target)
        self.mtp = [cast(Qwen3NextMTP, target.mtp)]

    def forward(self, batch: ForwardBatch, kv: KVCache,
                hidden: torch.Tensor | None) -> torch.Tensor:
        assert hidden is not None, "an MTP layer is fed the target's hidden states"
        cos, sin = self.parts.rope.cos_sin(batch.positions)  # [T, rotary_dim] each
        return self.mtp[0](self.parts.embed(batch.input_ids), hidden, cos, sin, batch, kv)

    def compute_logits(self, feature: torch.Tensor) -> torch.Tensor:
        return self.parts.logits(feature)


class DraftLM(DraftHead):
    """A small LM of the target's tokenizer whose attention layers are shifted to the KV
    cache's layers after the target's."""

    needs_hidden = False

    def __init__(self, draft: LlamaForCausalLM, first_layer: int) -> None:
        super().__init__()
        self.lm = draft
        self.num_layers = len(draft.model.layers)
        for module in draft.modules():
            if isinstance(module, Attention):
                module.layer += first_layer  # KV-cache layer first_layer + its own index

    def forward(self, batch: ForwardBatch, kv: KVCache,
                hidden: torch.Tensor | None) -> torch.Tensor:
        return self.lm(batch, kv)  # type: ignore[no-any-return]

    def graph_safe(self) -> bool:
        return self.lm.supports_cuda_graphs

    def compute_logits(self, feature: torch.Tensor) -> torch.Tensor:
        return self.lm.compute_logits(feature)
