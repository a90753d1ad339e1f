"""GPT-OSS (`GptOssForCausalLM`): the dense decoder's attention with sinks, MoE in every layer.

What differs from the Llama family (worker/model/llama.py), and where it lives:

- attention: q/k/v/o biases (`ArchConfig.qkv_bias`/`o_bias`), GQA, YaRN RoPE
  (worker/model/rope.py), alternating sliding-window / full layers (`layer_types`; one window,
  so the window layers keep a ring of pages, docs/hybrid-cache.md), and a learned **sink** per
  query head: a logit that joins every softmax's denominator and carries no value
  (`GptOssAttention.sinks`, passed to every attention path; worker/model/attention.py);
- MLP: `GptOssMoE`, a `SparseMoEBlock` (worker/model/moe.py: MoE TP / EP / DP over ranks) with a
  biased router (top-k over the logits, softmax over the chosen ones), experts with biases, and
  the clamped SwiGLU `(clamp(up) + 1) * g * sigmoid(alpha * g)`, `g = clamp(gate, max=limit)`.

Checkpoint layout (transformers' GptOssExperts, all experts of a layer in one tensor):
`mlp.router.{weight [E, H], bias [E]}`, `mlp.experts.gate_up_proj [E, H, 2I]` (x @ W, gate and
up **interleaved** along the last dim: gate = [..., 0::2], up = [..., 1::2]),
`gate_up_proj_bias [E, 2I]`, `down_proj [E, I, H]`, `down_proj_bias [E, H]`,
`self_attn.sinks [Hq]`. On load they are de-interleaved and transposed into the block's
`w13 [E_local, 2I_local, H]` (gate rows | up rows) and `w2 [E_local, H, I_local]`.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from worker.arch.gpt_oss_config import GptOssArch
from worker.arch.hf_config import ArchConfig
from worker.model.attention import AttentionBackend
from worker.model.base import WeightSlot
from worker.model.layers import TPInfo
from worker.model.llama import Attention, DecoderLayer, LlamaForCausalLM
from worker.model.moe import ExpertGroups, MoEParallel, SparseMoEBlock, grouped_linear
from worker.model.weights import TensorSource, copy_checked, empty_param

EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


class GptOssAttention(Attention):
    """Llama attention plus one sink logit per query head (this rank's heads, float32)."""

    def __init__(
        self, cfg: ArchConfig, layer: int, tp: TPInfo, backend: AttentionBackend, dtype: torch.dtype
    ) -> None:
        super().__init__(cfg, layer, tp, backend, dtype)
        self.tp_rank = tp.rank
        # float32 whatever the model dtype: the kernels add it to float32 scores.
        self.sinks = empty_param(self.num_heads, dtype=torch.float32)  # [Hq_local]

    def load(self, param: str, source: TensorSource, shard_id: object = None) -> None:
        assert param == "sinks" and self.sinks is not None
        start = self.tp_rank * self.num_heads  # this rank's query heads, as QKVParallelLinear's
        copy_checked(
            self.sinks.data, source.read(0, start, start + self.num_heads), "self_attn.sinks"
        )


class GptOssMoE(SparseMoEBlock):
    """GPT-OSS's expert layer on the shared MoE machinery (routing, EP all-to-all, MoE TP).

    Under MoE TP each rank holds an intermediate slice of every expert (bias slice included);
    the down projection's bias is added on rank 0 only, so the all-reduce adds it once. Under
    EP a rank holds whole experts and adds it itself.
    """

    def __init__(
        self,
        cfg: ArchConfig,
        family: GptOssArch,
        par: MoEParallel,
        dtype: torch.dtype | None = None,
    ) -> None:
        assert cfg.moe is not None
        moe = cfg.moe
        super().__init__(
            cfg.hidden_size, moe.intermediate_size, moe.num_experts, moe.top_k, True, par, dtype
        )
        self.alpha, self.limit = family.swiglu_alpha, family.swiglu_limit
        self.gate_bias = empty_param(moe.num_experts, dtype=dtype)  # router bias [E]
        self.w13_bias = empty_param(
            self.num_local, 2 * self.inter_local, dtype=dtype
        )  # [E_local, 2I_local]
        self.w2_bias = empty_param(self.num_local, self.hidden, dtype=dtype)  # [E_local, H]
        self.owns_down_bias = par.ep or par.rank == 0

    # ---- loading -----------------------------------------------------------------------------
    def load(self, param: str, source: TensorSource, shard_id: object = None) -> None:
        if param == "gate":
            copy_checked(self.gate.data, source.read(), "mlp.router.weight")
            return
        if param == "gate_bias":
            copy_checked(self.gate_bias.data, source.read(), "mlp.router.bias")
            return
        mine = source.read(
            0, self.first_expert, self.first_expert + self.num_local
        )  # [E_local, ...]
        start = 0 if self.par.ep else self.par.rank * self.inter_local
        cols = slice(start, start + self.inter_local)
        if param == "gate_up_proj":  # [E_local, H, 2I], gate|up interleaved on the last dim
            gate = mine[..., 0::2][..., cols].transpose(1, 2)  # [E_local, I_local, H]
            up = mine[..., 1::2][..., cols].transpose(1, 2)
            copy_checked(self.w13.data, torch.cat([gate, up], dim=1), "mlp.experts.gate_up_proj")
        elif param == "gate_up_proj_bias":  # [E_local, 2I], interleaved
            both = torch.cat([mine[:, 0::2][:, cols], mine[:, 1::2][:, cols]], dim=1)
            copy_checked(self.w13_bias.data, both, "mlp.experts.gate_up_proj_bias")
        elif param == "down_proj":  # [E_local, I, H]: this rank's input rows
            copy_checked(self.w2.data, mine[:, cols].transpose(1, 2), "mlp.experts.down_proj")
        elif param == "down_proj_bias":  # [E_local, H]
            copy_checked(self.w2_bias.data, mine, "mlp.experts.down_proj_bias")
        else:
            raise AssertionError(param)

    # ---- forward -----------------------------------------------------------------------------
    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] → (top-k expert ids [T, k], weights [T, k]): top-k over the biased logits,
        then a softmax over the k chosen logits only."""
        logits = F.linear(x, self.gate, self.gate_bias)  # [T, E]
        top, ids = torch.topk(logits, self.top_k, dim=-1)  # [T, k] each
        return ids, F.softmax(top, dim=-1, dtype=torch.float).to(x.dtype)

    def experts(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """rows [N, H], local expert of each row [N] → each row through its expert [N, H]
        (on MoE TP ranks > 0 without the down bias: the all-reduce adds rank 0's)."""
        groups = ExpertGroups.of(local_ids, self.num_local)
        x = groups.sort(rows)  # [N, H], expert-major
        gate, up = grouped_linear(x, self.w13, groups, self.w13_bias).chunk(2, dim=-1)  # [N, I]
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        act = (up + 1) * gate * torch.sigmoid(gate * self.alpha)  # [N, I_local]
        bias = self.w2_bias if self.owns_down_bias else None
        return groups.unsort(grouped_linear(act, self.w2, groups, bias))


class GptOssForCausalLM(LlamaForCausalLM):
    """GPT-OSS over the paged KV cache (one rank, attention TP, MoE TP or EP)."""

    def __init__(
        self,
        cfg: ArchConfig,
        tp: TPInfo,
        backend: AttentionBackend,
        dtype: torch.dtype,
        rope_device: torch.device | str = "cpu",
        moe: MoEParallel | None = None,
    ) -> None:
        super().__init__(cfg, tp, backend, dtype, rope_device)
        if not isinstance(cfg.family, GptOssArch) or cfg.moe is None:
            raise AssertionError(
                "GptOssForCausalLM needs an ArchConfig from gpt_oss_config.refine_gpt_oss"
            )
        par = moe or MoEParallel(size=tp.size, rank=tp.rank, group=tp.group)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = GptOssAttention(cfg, i, tp, backend, dtype)
            layer.mlp = GptOssMoE(cfg, cfg.family, par, dtype)

    @property
    def supports_cuda_graphs(self) -> bool:
        return False  # routing picks experts on the host (unique / split sizes) every step

    def weight_slots(self) -> dict[str, WeightSlot]:
        slots = super().weight_slots()
        for i, module in enumerate(self.model.layers):
            slots[f"model.layers.{i}.self_attn.sinks"] = WeightSlot(
                cast(DecoderLayer, module).self_attn, "sinks"
            )
        return slots

    def mlp_slots(self, prefix: str, mlp: nn.Module) -> dict[str, WeightSlot]:
        assert isinstance(mlp, GptOssMoE)
        slots = {
            f"{prefix}.mlp.router.weight": WeightSlot(mlp, "gate"),
            f"{prefix}.mlp.router.bias": WeightSlot(mlp, "gate_bias"),
        }
        for name in EXPERT_TENSORS:
            slots[f"{prefix}.mlp.experts.{name}"] = WeightSlot(mlp, name)
        return slots
