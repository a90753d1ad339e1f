"""DeepSeek-V3's MoE block: grouped top-k over sigmoid scores, plus always-on shared experts.

The experts, their loading and their spread over ranks (MoE TP or EP, all-to-all through
torch.distributed or DeepEP) are `SparseMoEBlock`'s (worker/model/moe.py); this block changes
only the router and adds the shared experts:

1. scores = sigmoid(x W_gate^T) in float32 (the router weight stays float32, as transformers
   keeps it);
2. the choice adds `e_score_correction_bias` (load balancing without an auxiliary loss): it
   decides which experts run, never how much they weigh;
3. grouped top-k: experts split into `n_group` groups, each scored by the sum of its best two
   biased scores; only the best `topk_group` groups may be picked; top-k experts among them;
4. weights = the unbiased scores of the picked experts, renormalized (`norm_topk_prob`), times
   `routed_scaling_factor`;
5. out = the routed experts' weighted sum + shared_experts(x) (a SwiGLU of n_shared *
   moe_intermediate_size, split over the attention TP ranks like a dense MLP).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.arch.deepseek_config import DeepseekArch
from worker.model.moe import MoEParallel, SparseMoEBlock
from worker.model.weights import TensorSource, copy_checked, empty_param


class DeepseekMoE(SparseMoEBlock):
    def __init__(
        self,
        hidden: int,
        inter: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        ds: DeepseekArch,
        shared: nn.Module | None,
        par: MoEParallel,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(hidden, inter, num_experts, top_k, norm_topk_prob, par, dtype)
        self.n_group, self.topk_group = ds.n_group, ds.topk_group
        self.routed_scaling_factor = ds.routed_scaling_factor
        self.gate = empty_param(num_experts, hidden, dtype=torch.float32)  # router [E, H], float32
        self.e_score_correction_bias = empty_param(num_experts, dtype=torch.float32)  # [E]
        self.shared_experts = shared  # None when n_shared_experts == 0

    def load(self, param: str, source: TensorSource, shard_id: object = None) -> None:
        if param == "e_score_correction_bias":
            copy_checked(
                self.e_score_correction_bias.data, source.read(), "gate.e_score_correction_bias"
            )
            return
        super().load(param, source, shard_id)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] → (expert ids [T, k], weights [T, k] in x's dtype); see the module doc."""
        t = x.shape[0]
        scores = F.linear(x.float(), self.gate).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias  # [T, E]
        per_group = self.num_experts // self.n_group
        group_scores = (
            choice.view(t, self.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        )  # [T, G]
        groups = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[
            1
        ]  # [T, topk_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)  # [T, G]
        keep = keep[:, :, None].expand(t, self.n_group, per_group).reshape(t, self.num_experts)
        ids = torch.topk(
            choice.masked_fill(~keep, float("-inf")), k=self.top_k, dim=-1, sorted=False
        )[1]
        weights = scores.gather(1, ids)  # [T, k]: unbiased scores
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, (weights * self.routed_scaling_factor).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, H] → [T, H]
        routed = super().forward(x)
        return routed if self.shared_experts is None else routed + self.shared_experts(x)
