"""The sparse MoE block (Qwen3-MoE style): a softmax top-k router over SwiGLU experts.

Two ways to spread it over the worker's ranks (`MoEParallel`):

- MoE TP (`ep=False`): every rank holds every expert with its intermediate features split,
  computes its part for every token and one all-reduce sums the parts — the dense MLP's rule.
- Expert parallel (`ep=True`): rank r holds experts [r*E/n, (r+1)*E/n) whole. Tokens travel
  to their experts' ranks and back: an all-to-all dispatch (rows + local expert ids), the
  experts on the received rows, an all-to-all combine, then each token sums its top-k rows
  with the router weights. With attention TP every rank holds the same tokens, so each rank
  dispatches only its 1/n slice and an all-gather rebuilds the batch (no token is computed
  twice); with attention DP (`tokens_replicated=False`) each rank dispatches its own tokens.

Under attention DP with MoE TP, each rank's tokens are first all-gathered (every rank then holds
every group's tokens), the TP rule runs on all of them, and each rank keeps its own rows.

The all-to-all runs through torch.distributed (gloo on CPU, NCCL on GPU), or through DeepEP's
normal kernels when `backend="deepep"` (CUDA + the deep_ep package; refused clearly otherwise).

Inside a CUDA graph (`graph_shapes`) every block takes the static-shape path of
worker/model/moe_static.py instead: no host sync, fixed-capacity all-to-alls (torch's, also
under `deepep`, whose normal kernels read counts on the host).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from worker.model.moe_static import forward_static
from worker.model.weights import TensorSource, WeightShapeError, copy_checked, empty_param


class MoEConfigError(ValueError):
    """The MoE layout asked for cannot run here; the message names the setting and the fix."""


@dataclass(frozen=True)
class MoEParallel:
    size: int = 1  # ranks the MoE layers span (tp_size * dp_size)
    rank: int = 0
    ep: bool = False  # True: experts split across ranks (all-to-all); False: MoE TP (all-reduce)
    # attention TP: all ranks hold the same tokens; attention DP: their own
    tokens_replicated: bool = True
    backend: str = "torch"  # all-to-all: torch | deepep
    group: dist.ProcessGroup | None = None  # None = the default group


def check_deepep(device: torch.device) -> None:
    """Refuse `all2all_backend: deepep` where it cannot run, before any weight is loaded."""
    try:
        import deep_ep  # noqa: F401
    except ImportError:
        raise MoEConfigError(
            "parallel.all2all_backend is 'deepep' but the deep_ep package is not installed; "
            "install DeepEP (github.com/deepseek-ai/DeepEP, needs CUDA and NVSHMEM) or set "
            "parallel.all2all_backend: torch"
        ) from None
    if device.type != "cuda":
        raise MoEConfigError(
            "parallel.all2all_backend 'deepep' needs CUDA devices; "
            "on CPU set all2all_backend: torch"
        )


@dataclass(frozen=True)
class ExpertGroups:
    """Rows grouped by expert: the permutation that sorts them and each expert's end offset."""

    order: torch.Tensor  # [N] int64: sorted position -> original row
    offsets: torch.Tensor  # [E] int32: cumulative row counts (the grouped GEMM's `offs`)
    sorted_ids: torch.Tensor  # [N] int64: the expert of each sorted row

    @classmethod
    def of(cls, local_ids: torch.Tensor, num_experts: int) -> ExpertGroups:
        sorted_ids, order = torch.sort(local_ids, stable=True)
        counts = torch.bincount(local_ids, minlength=num_experts)  # [E], on the device: no sync
        return cls(order, counts.cumsum(0).to(torch.int32), sorted_ids)

    def sort(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.index_select(0, self.order)

    def unsort(self, rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(rows)
        out[self.order] = rows
        return out


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: ExpertGroups,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, in] sorted by expert, weight [E, out, in] (bias [E, out]) → [N, out]: each row times
    its expert's weight, with no loop over experts and no host sync. torch's grouped GEMM where
    it runs (at 16-byte-aligned widths: the CPU; CUDA for bfloat16, CUTLASS on sm90); elsewhere
    (e.g. an odd moe_intermediate_size) a loop over the experts, the reference it is tested
    against."""
    n, e = x.shape[0], weight.shape[0]
    aligned = all(d * x.element_size() % 16 == 0 for d in weight.shape[1:])
    if n and aligned and (not x.is_cuda or x.dtype == torch.bfloat16):
        y = torch._grouped_mm(x, weight.transpose(1, 2), offs=groups.offsets)  # [N, out]
    else:
        y = x.new_empty(n, weight.shape[1])
        ends = groups.offsets.tolist() if n else [0] * e
        start = 0
        for i, end in enumerate(ends):
            if end > start:
                y[start:end] = F.linear(x[start:end], weight[i])
            start = end
    if bias is not None:
        y = y + bias.index_select(0, groups.sorted_ids)
    return y


class SparseMoEBlock(nn.Module):
    def __init__(
        self,
        hidden: int,
        inter: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        par: MoEParallel,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if par.ep and num_experts % par.size:
            raise WeightShapeError(
                f"num_experts ({num_experts}) must be divisible by ep_size ({par.size})"
            )
        if not par.ep and inter % par.size:
            raise WeightShapeError(
                f"moe_intermediate_size ({inter}) must be divisible by the MoE TP size ({par.size})"
            )
        self.par = par
        self.hidden, self.top_k, self.norm_topk_prob = hidden, top_k, norm_topk_prob
        self.num_experts = num_experts
        self.num_local = num_experts // par.size if par.ep else num_experts
        self.first_expert = par.rank * self.num_local if par.ep else 0
        self.inter_local = inter if par.ep else inter // par.size
        self.gate = empty_param(num_experts, hidden, dtype=dtype)  # router [E, hidden], replicated
        # [E_local, 2I, H]: gate|up
        self.w13 = empty_param(self.num_local, 2 * self.inter_local, hidden, dtype=dtype)
        # [E_local, H, I]
        self.w2 = empty_param(self.num_local, hidden, self.inter_local, dtype=dtype)
        self._deepep: Any = None  # deep_ep.Buffer, built at the first dispatch
        # True only inside `graph_shapes` (a decode graph's warm-up, capture or CPU replay): the
        # path a CUDA graph can hold. Every rank enters it for the same steps.
        self.static_shapes = False

    @property
    def plain_swiglu(self) -> bool:
        """Whether `experts` is this class's plain SwiGLU (what the graph-safe kernel computes)."""
        return type(self).experts is SparseMoEBlock.experts

    # ---- loading -----------------------------------------------------------------------------
    def expert_ids(self) -> range:
        """Global ids of the experts this rank holds (their checkpoint tensors are all it reads)."""
        return range(self.first_expert, self.first_expert + self.num_local)

    def load(self, param: str, source: TensorSource, shard_id: object = None) -> None:
        if param == "gate":
            copy_checked(self.gate.data, source.read(), "SparseMoEBlock.gate")
            return
        # (global expert id, "gate" | "up" | "down")
        expert, piece = cast(tuple[int, str], shard_id)
        e = int(expert) - self.first_expert
        start = 0 if self.par.ep else self.par.rank * self.inter_local
        stop = start + self.inter_local
        if piece == "down":  # [H, I]: this rank's input columns
            copy_checked(
                self.w2.data[e], source.read(1, start, stop), f"experts.{expert}.down_proj"
            )
        else:  # [I, H]: this rank's output rows, gate first then up
            off = 0 if piece == "gate" else self.inter_local
            copy_checked(
                self.w13.data[e, off : off + self.inter_local],
                source.read(0, start, stop),
                f"experts.{expert}.{piece}_proj",
            )

    # ---- forward -----------------------------------------------------------------------------
    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] → (top-k expert ids [T, k], weights [T, k] in x's dtype), as transformers does.
        """
        probs = F.softmax(F.linear(x, self.gate), dim=-1, dtype=torch.float)  # [T, E]
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(x.dtype)

    def experts(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """rows [N, H], local expert of each row [N] → each row through its expert [N, H]:
        the rows sorted by expert, one grouped GEMM per projection (`grouped_linear`)."""
        groups = ExpertGroups.of(local_ids, self.num_local)
        x = groups.sort(rows)  # [N, H], expert-major
        gate, up = grouped_linear(x, self.w13, groups).chunk(2, dim=-1)  # [N, I] each
        return groups.unsort(grouped_linear(F.silu(gate) * up, self.w2, groups))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, H] → [T, H]
        if self.static_shapes:
            return forward_static(self, x)
        if not self.par.ep and not self.par.tokens_replicated and self.par.size > 1:
            return self._tp_over_dp(x)
        ids, weights = self.route(x)
        if not self.par.ep:
            flat = ids.reshape(-1)  # [T*k]
            # [T*k, H] (partial over I)
            rows = self.experts(x.repeat_interleave(self.top_k, dim=0), flat)
            y = (rows.view(-1, self.top_k, self.hidden) * weights[..., None]).sum(dim=1)
            if self.par.size > 1:
                dist.all_reduce(y, group=self.par.group)
            return y
        if self.par.size == 1:
            return self._combine_local(
                x, ids, weights, self.experts(x.repeat_interleave(self.top_k, 0), ids.reshape(-1))
            )
        if not self.par.tokens_replicated:
            return self._ep(x, ids, weights)
        # Attention TP: every rank has all T tokens; each dispatches its slice, then all-gather.
        sizes = [len(s) for s in torch.arange(x.shape[0]).tensor_split(self.par.size)]
        start = sum(sizes[: self.par.rank])
        mine = slice(start, start + sizes[self.par.rank])
        y_mine = self._ep(x[mine], ids[mine], weights[mine])  # [T_r, H]
        # tensor_split: the first slices are the longest; gloo gathers equal shapes
        width = sizes[0]
        padded = x.new_zeros(width, self.hidden)
        padded[: y_mine.shape[0]] = y_mine
        parts = [x.new_empty(width, self.hidden) for _ in sizes]
        dist.all_gather(parts, padded, group=self.par.group)
        return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])  # [T, H]

    def _tp_over_dp(self, x: torch.Tensor) -> torch.Tensor:
        """MoE TP under attention DP: every rank's tokens gathered, each rank's feature slice of
        every expert over all of them, one all-reduce, then each rank keeps its own rows."""
        n = self.par.size
        count = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
        counts = [torch.empty_like(count) for _ in range(n)]
        dist.all_gather(counts, count, group=self.par.group)
        sizes = [int(c) for c in counts]
        width = max(sizes)
        if width == 0:  # every rank idle this step
            return x
        padded = x.new_zeros(width, self.hidden)  # gloo gathers equal shapes
        padded[: x.shape[0]] = x
        parts = [x.new_empty(width, self.hidden) for _ in range(n)]
        dist.all_gather(parts, padded, group=self.par.group)
        everyone = torch.cat([p[:k] for p, k in zip(parts, sizes, strict=True)])  # [sum T, H]
        ids, weights = self.route(everyone)
        # partial over I
        rows = self.experts(everyone.repeat_interleave(self.top_k, dim=0), ids.reshape(-1))
        y = (rows.view(-1, self.top_k, self.hidden) * weights[..., None]).sum(dim=1)
        dist.all_reduce(y, group=self.par.group)
        start = sum(sizes[: self.par.rank])
        return y[start : start + x.shape[0]]

    def _combine_local(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        return (rows.view(-1, self.top_k, self.hidden) * weights[..., None]).sum(dim=1)  # [T, H]

    def _ep(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Expert-parallel MoE over this rank's tokens x [T, H] (T may be 0)."""
        if self.par.backend == "deepep":
            return self._ep_deepep(x, ids, weights)
        n, k = self.par.size, self.top_k
        flat = ids.reshape(-1)  # [T*k] global expert of each (token, slot)
        owner = flat // self.num_local  # [T*k] rank holding it
        order = torch.argsort(owner, stable=True)  # group sends by destination rank
        send_counts = torch.bincount(owner, minlength=n)  # [n]
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.par.group)
        send_split, recv_split = send_counts.tolist(), recv_counts.tolist()
        send_rows = x.repeat_interleave(k, dim=0)[order]  # [T*k, H]
        recv_rows = x.new_empty(sum(recv_split), self.hidden)
        dist.all_to_all_single(recv_rows, send_rows, recv_split, send_split, group=self.par.group)
        send_local = (flat[order] % self.num_local).to(torch.int64)  # expert id on its owner
        recv_local = torch.empty(sum(recv_split), dtype=torch.int64, device=x.device)
        dist.all_to_all_single(recv_local, send_local, recv_split, send_split, group=self.par.group)
        done = self.experts(recv_rows, recv_local)  # [R, H]
        back = x.new_empty(flat.shape[0], self.hidden)
        # combine: same order
        dist.all_to_all_single(back, done, send_split, recv_split, group=self.par.group)
        rows = torch.empty_like(back)
        rows[order] = back  # [T*k, H] back in (token, slot) order
        return self._combine_local(x, ids, weights, rows)

    def _ep_deepep(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """DeepEP normal-mode dispatch / combine (CUDA, intranode over NVLink). Weighted on the
        expert side: combine sums. DeepEP moves bfloat16 rows (its combine kernel has no other
        type), so a float32 model's rows travel as bfloat16 and come back in x's dtype."""
        import deep_ep

        if self._deepep is None:
            group = self.par.group or dist.group.WORLD
            hidden_bytes = self.hidden * 2  # bfloat16 rows
            cfgs = (deep_ep.Buffer.get_dispatch_config(self.par.size),
                    deep_ep.Buffer.get_combine_config(self.par.size))
            nvl = max(c.get_nvl_buffer_size_hint(hidden_bytes, self.par.size) for c in cfgs)
            self._deepep = deep_ep.Buffer(group, nvl, 0)
        buf = self._deepep
        if not x.shape[0]:  # an idle DP group still joins: one token that selects no expert
            one = self._ep_deepep(x.new_zeros(1, self.hidden), ids.new_full((1, self.top_k), -1),
                                  weights.new_zeros(1, self.top_k))
            return one[:0]
        ids = ids.contiguous()  # [T, k] int64 (deep_ep.topk_idx_t); -1 selects no expert
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, self.num_experts)
        recv_x, recv_ids, recv_w, _, handle, _ = buf.dispatch(
            x.to(torch.bfloat16).contiguous(), topk_idx=ids,
            topk_weights=weights.float().contiguous(), num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
        )
        # [R, H]: each received token, summed over its experts on this rank (recv_ids holds
        # local expert ids, -1 where that slot's expert is elsewhere)
        out = torch.zeros(recv_x.shape, dtype=x.dtype, device=x.device)
        for slot in range(recv_ids.shape[1]):
            sel = (recv_ids[:, slot] >= 0).nonzero(as_tuple=True)[0]
            if sel.numel():
                rows = self.experts(recv_x[sel].to(x.dtype), recv_ids[sel, slot].to(torch.int64))
                out[sel] += rows * recv_w[sel, slot, None].to(rows.dtype)
        combined, _, _ = buf.combine(out.to(torch.bfloat16), handle)
        return combined.to(x.dtype)  # type: ignore[no-any-return]

@contextlib.contextmanager
def graph_shapes(model: nn.Module) -> Iterator[None]:
    """Every SparseMoEBlock of `model` on its static-shape path while inside (decode graphs)."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoEBlock)]
    for b in blocks:
        b.static_shapes = True
    try:
        yield
    finally:
        for b in blocks:
            b.static_shapes = False
