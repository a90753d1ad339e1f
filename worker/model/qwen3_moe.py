"""Qwen3-MoE (`Qwen3MoeForCausalLM`): the Qwen3 dense decoder with sparse MoE blocks.

Attention, norms, embeddings and RoPE are the dense family's (worker/model/llama.py); the
layers that config.json marks sparse swap their SwiGLU MLP for a `SparseMoEBlock`
(worker/model/moe.py). Checkpoint names follow transformers: `mlp.gate.weight` (router) and
`mlp.experts.{e}.{gate,up,down}_proj.weight`; with expert parallelism a rank lists (and so
reads) only its own experts' tensors.
"""

from __future__ import annotations

import torch
from torch import nn

from worker.arch.hf_config import ArchConfig
from worker.model.attention import AttentionBackend
from worker.model.base import WeightSlot
from worker.model.layers import TPInfo
from worker.model.llama import LlamaForCausalLM
from worker.model.moe import MoEParallel, SparseMoEBlock


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    def __init__(
        self, cfg: ArchConfig, tp: TPInfo, backend: AttentionBackend, dtype: torch.dtype,
        rope_device: torch.device | str = "cpu", moe: MoEParallel | None = None,
    ) -> None:
        super().__init__(cfg, tp, backend, dtype, rope_device)
        assert cfg.moe is not None, "Qwen3MoeForCausalLM needs config.json's MoE fields"
        par = moe or MoEParallel(size=tp.size, rank=tp.rank, group=tp.group)
        for layer, sparse in zip(self.model.layers, cfg.moe.sparse_layers, strict=True):
            if sparse:
                layer.mlp = SparseMoEBlock(
                    cfg.hidden_size, cfg.moe.intermediate_size, cfg.moe.num_experts, cfg.moe.top_k,
                    cfg.moe.norm_topk_prob, par, dtype,
                )

    @property
    def supports_cuda_graphs(self) -> bool:
        # Eager routing picks experts on the host; inside graphs the blocks take their static
        # path (worker/model/moe_static.py).
        return True

    def mlp_slots(self, prefix: str, mlp: nn.Module) -> dict[str, WeightSlot]:
        if not isinstance(mlp, SparseMoEBlock):
            return super().mlp_slots(prefix, mlp)
        slots = {f"{prefix}.mlp.gate.weight": WeightSlot(mlp, "gate")}
        for e in mlp.expert_ids():
            for piece in ("gate", "up", "down"):
                slots[f"{prefix}.mlp.experts.{e}.{piece}_proj.weight"] = WeightSlot(
                    mlp, "experts", (e, piece)
                )
        return slots
