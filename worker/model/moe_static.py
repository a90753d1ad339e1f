"""Static-shape MoE for CUDA graphs: the layouts of worker/model/moe.py with every shape fixed by
the token count and nothing read on the host.

In a captured decode step every rank replays the same bucket, so every rank holds T tokens:
- Expert parallel: each rank sends every peer a fixed-capacity block of C = T*k rows (the worst
  case: all of its (token, slot) pairs on that one peer), its rows at the block's front, with
  the local expert of each row (-1 = empty slot). Equal splits, so the all-to-alls need no
  counts. Under attention TP each rank takes a ceil(T/n) slice first (zero rows pad the last
  one) and an all-gather rebuilds the batch, as the eager path does.
- MoE TP under attention DP: every rank's T rows are gathered (equal shapes: no counts), each
  rank runs its feature slice of every expert over all of them, one all-reduce, own rows kept.
- MoE TP under attention TP, and one rank: the experts over the rows, as eager.

Experts run through worker/model/moe_kernels.py on CUDA (sorted blocks + grouped GEMM, no host
sync); on a CPU (tests; the eager "replay" of worker/cuda_graphs.py) through the block's own
reference `experts` over the valid rows. Empty slots and padding rows cost compute but never
reach a token's output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from worker.model import moe_kernels

if TYPE_CHECKING:
    from worker.model.moe import MoEParallel


class MoEParts(Protocol):
    """What the static path needs of a SparseMoEBlock (kept structural: moe.py imports us)."""

    par: MoEParallel
    top_k: int
    hidden: int
    num_local: int

    @property
    def w13(self) -> torch.Tensor: ...  # [E_local, 2I, H]: gate|up

    @property
    def w2(self) -> torch.Tensor: ...  # [E_local, H, I]

    @property
    def plain_swiglu(self) -> bool: ...

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def experts(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor: ...


def forward_static(block: MoEParts, x: torch.Tensor) -> torch.Tensor:  # x: [T, H] → [T, H]
    par = block.par
    if not par.ep:
        if par.size > 1 and not par.tokens_replicated:
            return _tp_over_dp(block, x)
        y = _local(block, x)
        if par.size > 1:
            dist.all_reduce(y, group=par.group)
        return y
    if par.size == 1:
        return _local(block, x)
    if not par.tokens_replicated:
        return _ep(block, x)
    # Attention TP: every rank holds all T tokens; each dispatches its padded slice.
    n, t = par.size, x.shape[0]
    width = -(-t // n)
    padded = x.new_zeros(n * width, block.hidden)  # [n*width, H]
    padded[:t] = x
    y = _ep(block, padded[par.rank * width : (par.rank + 1) * width].contiguous())  # [width, H]
    parts = [torch.empty_like(y) for _ in range(n)]
    dist.all_gather(parts, y, group=par.group)
    return torch.cat(parts)[:t]


def _local(block: MoEParts, x: torch.Tensor) -> torch.Tensor:
    """Every (token, slot) through this rank's experts (all experts, or their feature slices)."""
    ids, weights = block.route(x)  # [T, k] each
    rows = experts(block, _per_slot(x, block.top_k), ids.reshape(-1))  # [T*k, H]
    return _combine(block, rows, weights)


def _per_slot(x: torch.Tensor, k: int) -> torch.Tensor:
    """x [T, H] → [T*k, H], each token once per slot (an expand: no host-side size sum)."""
    return x[:, None, :].expand(-1, k, -1).reshape(-1, x.shape[-1])


def _tp_over_dp(block: MoEParts, x: torch.Tensor) -> torch.Tensor:
    par = block.par
    t = x.shape[0]
    parts = [torch.empty_like(x) for _ in range(par.size)]
    dist.all_gather(parts, x.contiguous(), group=par.group)
    y = _local(block, torch.cat(parts))  # [n*T, H], partial over the feature slices
    dist.all_reduce(y, group=par.group)
    return y[par.rank * t : (par.rank + 1) * t]


def _ep(block: MoEParts, x: torch.Tensor) -> torch.Tensor:
    """Expert-parallel MoE over this rank's T tokens with fixed-capacity blocks per peer."""
    par, k, h = block.par, block.top_k, block.hidden
    n, dev = par.size, x.device
    ids, weights = block.route(x)  # [T, k] global expert ids
    flat = ids.reshape(-1)  # [C] with C = T*k: the capacity of one peer's block
    cap = flat.numel()
    owner = flat // block.num_local  # [C] the rank holding each slot's expert
    order = torch.argsort(owner, stable=True)  # slots grouped by destination rank
    counts = torch.zeros(n, dtype=torch.int64, device=dev).scatter_add_(0, owner,
                                                                       torch.ones_like(owner))
    first = torch.cumsum(counts, 0) - counts  # [n] where each destination's run starts
    to = owner[order]
    place = to * cap + torch.arange(cap, device=dev) - first[to]  # [C] unique in [0, n*C)
    send_rows = x.new_zeros(n * cap, h)
    send_rows[place] = _per_slot(x, k)[order]
    send_ids = torch.full((n * cap,), -1, dtype=torch.int64, device=dev)
    send_ids[place] = flat[order] % block.num_local
    recv_rows, recv_ids = torch.empty_like(send_rows), torch.empty_like(send_ids)
    dist.all_to_all_single(recv_rows, send_rows, group=par.group)
    dist.all_to_all_single(recv_ids, send_ids, group=par.group)
    done = experts(block, recv_rows, recv_ids)  # [n*C, H]; empty slots give zeros
    back = torch.empty_like(done)
    dist.all_to_all_single(back, done, group=par.group)  # each block back to its sender
    rows = torch.empty(cap, h, dtype=x.dtype, device=dev)
    rows[order] = back[place]  # [C, H] in (token, slot) order
    return _combine(block, rows, weights)


def experts(block: MoEParts, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
    """rows [R, H], local expert of each [R] (-1 = none) → [R, H], zero where none."""
    if rows.is_cuda:
        if not block.plain_swiglu:
            raise NotImplementedError(f"{type(block).__name__} has its own experts and no "
                                      "graph-safe kernel; its model must not capture graphs")
        return moe_kernels.swiglu_experts(rows, local_ids, block.w13, block.w2)
    out = torch.zeros_like(rows)
    valid = (local_ids >= 0).nonzero(as_tuple=True)[0]  # a host sync: fine on a CPU
    if valid.numel():
        out[valid] = block.experts(rows[valid], local_ids[valid])
    return out


def _combine(block: MoEParts, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """rows [T*k, H] in (token, slot) order, weights [T, k] → each token's weighted sum [T, H]."""
    return (rows.view(-1, block.top_k, block.hidden) * weights[..., None]).sum(dim=1)
