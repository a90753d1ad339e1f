"""Qwen3-Next's linear-attention layer: Gated DeltaNet over a per-request state slot.

    x ─ in_proj_qkvz ─ q k v z      (grouped by key head: [q_j, k_j, v_j.., z_j..] per head j)
      └ in_proj_ba ── b a           (per value head: beta = sigmoid(b), decay g from a)
    q|k|v ─ causal depthwise conv (K taps, SiLU; the conv state holds the last K-1 inputs)
          ─ gated delta rule (q, k l2-normalized; state [Hv, Dk, Dv] float32)
          ─ RMSNorm per value head, times SiLU(z) ─ out_proj

    g = -exp(A_log) * softplus(a + dt_bias)     (log decay per value head, <= 0)

The layer keeps no K/V: its memory is one slot of the KV cache's state region
(`KVCache.state(layer)`: conv [slots, K-1, conv_dim], ssm [slots, Hv, Dk, Dv]), picked per
request by `ForwardBatch.state_slots`. The conv and the rule run as the torch reference
(worker/model/gated_delta.py) or, with `fused` set (CUDA), as Triton kernels
(worker/model/gated_delta_triton.py) with the same contract.

Tensor parallelism splits by key head: rank r holds key heads [r*Hk/n, (r+1)*Hk/n) and their
value heads. in_proj_qkvz / in_proj_ba are grouped by key head, so a rank's rows are one
contiguous block; the conv weight is laid out q | k | v over all heads, so a rank reads three
slices of it; out_proj is row-parallel over the value heads (one all-reduce).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.arch.qwen3_next_config import Qwen3NextArch
from worker.batch import ForwardBatch
from worker.kv_cache import KVCache, StateShape
from worker.model import gated_delta, gated_delta_triton
from worker.model.layers import ColumnParallelLinear, RMSNorm, RowParallelLinear, TPInfo
from worker.model.weights import TensorSource, WeightShapeError, copy_checked, empty_param


class _HeadSlices(nn.Module):
    """Per-value-head parameters (A_log, dt_bias) and the conv weight, sliced to this rank."""

    def __init__(self, arch: Qwen3NextArch, tp: TPInfo, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.tp = tp
        self.kd = arch.num_k_heads // tp.size * arch.head_k_dim  # one rank's q (or k) channels
        self.vd = arch.num_v_heads // tp.size * arch.head_v_dim  # one rank's v channels
        self.nv = arch.num_v_heads // tp.size
        self.key_dim = arch.num_k_heads * arch.head_k_dim  # the model's q (or k) channels
        self.A_log = empty_param(self.nv, dtype=dtype)  # [Hv_local]
        self.dt_bias = empty_param(self.nv, dtype=dtype)  # [Hv_local]
        # [C_local, K]
        self.conv = empty_param(2 * self.kd + self.vd, arch.conv_kernel, dtype=dtype)

    def load(self, param: str, source: TensorSource, shard_id: object = None) -> None:
        r = self.tp.rank
        if param in ("A_log", "dt_bias"):
            copy_checked(getattr(self, param).data, source.read(0, r * self.nv, (r + 1) * self.nv),
                         f"linear_attn.{param}")
            return
        # conv1d.weight [conv_dim, 1, K], rows q | k | v over every head: this rank's three slices.
        pieces = [(r * self.kd, self.kd), (self.key_dim + r * self.kd, self.kd),
                  (2 * self.key_dim + r * self.vd, self.vd)]
        rows = torch.cat([source.read(0, start, start + n) for start, n in pieces])  # [C_l, 1, K]
        copy_checked(self.conv.data, rows[:, 0], "linear_attn.conv1d.weight")


class GatedDeltaNet(nn.Module):
    def __init__(
        self, hidden: int, arch: Qwen3NextArch, layer: int, eps: float, tp: TPInfo,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if arch.num_k_heads % tp.size:
            raise WeightShapeError(f"linear_num_key_heads ({arch.num_k_heads}) must be divisible "
                                   f"by tp_size ({tp.size})")
        self.layer = layer
        self.nk = arch.num_k_heads // tp.size  # key heads on this rank
        self.nv = arch.num_v_heads // tp.size  # value heads on this rank
        self.dk, self.dv = arch.head_k_dim, arch.head_v_dim
        self.rep = arch.num_v_heads // arch.num_k_heads  # value heads per key head
        self.conv_kernel = arch.conv_kernel
        group = 2 * self.dk + 2 * self.rep * self.dv  # q, k, v.., z.. of one key head
        nk = arch.num_k_heads
        self.in_proj_qkvz = ColumnParallelLinear(hidden, [nk * group], False, tp, dtype)
        self.in_proj_ba = ColumnParallelLinear(hidden, [nk * 2 * self.rep], False, tp, dtype)
        self.heads = _HeadSlices(arch, tp, dtype)
        self.norm = RMSNorm(self.dv, eps, dtype)  # the gated norm's weight (plain, not 1 + w)
        self.out_proj = RowParallelLinear(arch.num_v_heads * self.dv, hidden, False, tp, dtype)
        self.fused = False  # Triton conv + delta rule (set by the model's set_fused_kernels)
        # Speculative verify steps: the state after each token of a verify chunk, by slot, so
        # `commit` can keep the one after the last accepted draft (the step leaves the state
        # after every draft, rejected ones too). Set by each forward that verifies.
        self._traces: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _trace(self, conv0: torch.Tensor, ssm0: torch.Tensor, conv_in: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """A verify chunk's state after each of its n tokens, from the state before it:
        conv [n, K-1, C] (the last K-1 inputs up to each token) and ssm [n, Hv, Dk, Dv] (the
        recurrence of worker/model/gated_delta.py, token by token; a few tokens)."""
        keep = self.conv_kernel - 1
        history = torch.cat([conv0.to(conv_in.dtype), conv_in])  # [K-1+n, C]
        n = conv_in.shape[0]
        conv = torch.stack([history[j + 1 : j + 1 + keep] for j in range(n)])  # [n, K-1, C]
        k = gated_delta.l2norm(k.float()).repeat_interleave(self.rep, dim=1)  # [n, Hv, Dk]
        state = ssm0.float().clone()[None]  # [1, Hv, Dk, Dv]
        states = []
        for j in range(n):  # q only makes the output: k stands in for it
            gated_delta.recurrent_step(k[j, None], k[j, None], v[j, None].float(), g[j, None],
                                       beta[j, None], state)
            states.append(state[0].clone())
        return conv, torch.stack(states)

    def commit(self, kv: KVCache, accepted: dict[int, int]) -> None:
        """After a verify: slot -> index of its last accepted token; its state becomes the
        one after that token."""
        conv_state, ssm_state = kv.state(self.layer)
        for slot, j in accepted.items():
            conv, ssm = self._traces[slot]
            conv_state[slot] = conv[j].to(conv_state.dtype)
            ssm_state[slot] = ssm[j].to(ssm_state.dtype)
        self._traces = {}

    def state_shape(self, dtype: torch.dtype) -> StateShape:
        conv_dim = 2 * self.nk * self.dk + self.nv * self.dv
        return StateShape(conv=(self.conv_kernel - 1, conv_dim), ssm=(self.nv, self.dk, self.dv),
                          conv_dtype=dtype, ssm_dtype=torch.float32)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """x [T, hidden] → [T, hidden]; reads and advances each request's state slot."""
        if batch.state_slots is None:
            raise ValueError(
                "a Gated DeltaNet layer needs ForwardBatch.state_slots (one per request)")
        t = x.shape[0]
        qkvz = self.in_proj_qkvz(x).view(t, self.nk, -1)  # [T, Hk, 2Dk + 2 rep Dv]
        rv = self.rep * self.dv
        q, k, v, z = qkvz.split([self.dk, self.dk, rv, rv], dim=-1)
        b, a = self.in_proj_ba(x).view(t, self.nk, 2 * self.rep).split([self.rep, self.rep], dim=-1)
        # Channels in the conv's order: q of every head | k of every head | v of every head.
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)  # [T, C]
        conv_state, ssm_state = kv.state(self.layer)  # [S, K-1, C], [S, Hv, Dk, Dv]
        ops = gated_delta_triton if self.fused else gated_delta  # one contract, two backends
        slots, qs, qs_list = batch.state_slots, batch.query_start, batch.query_start_list
        self._traces = {}
        entry = {i: (conv_state[s].clone(), ssm_state[s].clone())  # before the verify's tokens
                 for i, s in zip(batch.verify_requests, slots[batch.verify_requests].tolist(),
                                 strict=True)} if batch.verify_requests else {}
        conv_in = mixed
        mixed = ops.causal_conv(mixed, self.heads.conv, conv_state, slots, qs, qs_list)
        kd = self.nk * self.dk
        q, k, v = mixed.split([kd, kd, self.nv * self.dv], dim=-1)
        beta = b.reshape(t, self.nv).sigmoid().float()  # [T, Hv]: how strongly each token writes
        # float32 before exp: in half precision exp(A_log) may overflow.
        dt = F.softplus(a.reshape(t, self.nv).float() + self.heads.dt_bias)  # [T, Hv]
        g = -self.heads.A_log.float().exp() * dt  # [T, Hv]: log decay, <= 0
        o = ops.gated_delta_rule(
            q.reshape(t, self.nk, self.dk), k.reshape(t, self.nk, self.dk),
            v.reshape(t, self.nv, self.dv), g, beta, ssm_state, slots, qs, qs_list,
        ).to(x.dtype)  # [T, Hv, Dv]
        for i, (conv0, ssm0) in entry.items():
            rows = slice(qs_list[i], qs_list[i + 1])
            self._traces[int(slots[i])] = self._trace(
                conv0, ssm0, conv_in[rows], k[rows].reshape(-1, self.nk, self.dk),
                v[rows].reshape(-1, self.nv, self.dv), g[rows], beta[rows])
        o = (self.norm(o) * F.silu(z.reshape(t, self.nv, self.dv).float())).to(x.dtype)
        return self.out_proj(o.reshape(t, self.nv * self.dv))

