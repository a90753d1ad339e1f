"""Gated DeltaNet's sequence mixers in torch: the causal depthwise conv and the gated delta rule.

These are the CPU path and the reference the Triton kernels (worker/model/gated_delta_triton.py)
are checked against. Both work on a whole step's flattened tokens, request after request
(`query_start_list`), with each request's state in its slot of the KV cache's state region
(`KVCache.state(layer)`, indexed by `ForwardBatch.state_slots`): the slot holds the state after
the request's earlier tokens when the step starts, and the state after this step's tokens when
it ends. A request decoding one token takes the recurrent step (batched over every such request);
a request with a multi-token chunk takes the chunked form (a loop over those requests).

The gated delta rule, per value head, with state S [head_k_dim, head_v_dim] (float32):

    S   <- exp(g_t) * S                      # decay (g_t <= 0, in log space)
    u_t  = beta_t * (v_t - S^T k_t)          # the delta rule: write only what S mispredicts
    S   <- S + k_t u_t^T
    o_t  = S^T q_t                           # q, k l2-normalized; q scaled by head_k_dim^-0.5

The chunked form computes the same thing C tokens at a time with matmuls: inside a chunk the
writes u depend on each other through a unit lower-triangular system (I + A) u = rhs, with
A[t, s] = beta_t * exp(G_t - G_s) * (k_t . k_s) for s < t (G = cumulative g inside the chunk),
solved once per chunk. Same math as transformers' torch fallback (`torch_chunk_gated_delta_rule`),
written from the recurrence above; tests/worker/test_gated_delta.py holds the two together.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # tokens per chunk of the chunked rule (transformers' and FLA's default)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x [..., D] / sqrt(sum x^2 + eps) over the last dim (the FLA convention)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


# ---- causal depthwise conv -------------------------------------------------------------------
def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, state_slots: torch.Tensor,
    query_start: torch.Tensor, query_start_list: list[int],
) -> torch.Tensor:
    """SiLU(causal depthwise conv) of every request's new inputs, over its conv state.

    x [T, C] (this step's inputs), weight [C, K], conv_state [num_slots, K-1, C] (updated in
    place: afterwards it holds each request's last K-1 inputs) → [T, C] in x's dtype.
    `query_start` [B+1] is the device copy of `query_start_list` (the Triton kernels read it).
    """
    out = torch.empty_like(x)
    decodes = [i for i in range(len(query_start_list) - 1)
               if query_start_list[i + 1] - query_start_list[i] == 1]
    if decodes:
        rows = torch.tensor([query_start_list[i] for i in decodes], device=x.device)  # [B']
        slots = state_slots[decodes]  # [B']
        out[rows] = causal_conv_step(x[rows], weight, conv_state, slots)
    chunks = [i for i in range(len(query_start_list) - 1)
              if query_start_list[i + 1] - query_start_list[i] > 1]
    slot_ids = state_slots.tolist() if chunks else []  # host ints: conv_state[slot] is a view
    for i in chunks:
        start, end = query_start_list[i], query_start_list[i + 1]
        out[start:end] = causal_conv_chunk(x[start:end], weight, conv_state[slot_ids[i]])
    return out


def causal_conv_chunk(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One request's chunk: x [n, C], weight [C, K], state [K-1, C] (its previous inputs,
    updated in place) → SiLU(conv) [n, C]."""
    keep = weight.shape[1] - 1
    full = torch.cat([state.to(x.dtype), x])  # [K-1+n, C]: history then the new inputs
    # Depthwise: each channel its own K-tap filter; no padding, so output j ends at input j.
    y = F.conv1d(full.t()[None], weight[:, None, :].to(x.dtype), groups=x.shape[1])  # [1, C, n]
    state.copy_(full[full.shape[0] - keep :])
    return F.silu(y[0].t())


def causal_conv_step(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """One new input per request: x [B, C], slots [B] → SiLU(conv) [B, C]; shifts the states."""
    window = torch.cat([conv_state[slots].to(x.dtype), x[:, None]], dim=1)  # [B, K, C]
    y = (window * weight.t().to(x.dtype)[None]).sum(dim=1)  # [B, C]
    conv_state[slots] = window[:, 1:].to(conv_state.dtype)
    return F.silu(y)


# ---- gated delta rule ------------------------------------------------------------------------
def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    ssm_state: torch.Tensor, state_slots: torch.Tensor, query_start: torch.Tensor,
    query_start_list: list[int],
) -> torch.Tensor:
    """The rule over a step's tokens.

    q, k [T, Hk, Dk] (raw: l2-normalized and scaled here), v [T, Hv, Dv], g, beta [T, Hv]
    (float32), ssm_state [num_slots, Hv, Dk, Dv] float32 (updated in place) → o [T, Hv, Dv]
    float32. Value head h reads key head h // (Hv / Hk) (GQA-style repetition).
    """
    rep = v.shape[1] // k.shape[1]
    q = l2norm(q.float()).repeat_interleave(rep, dim=1) * q.shape[-1] ** -0.5  # [T, Hv, Dk]
    k = l2norm(k.float()).repeat_interleave(rep, dim=1)  # [T, Hv, Dk]
    v = v.float()
    out = torch.empty_like(v)  # [T, Hv, Dv]
    qs = query_start_list
    decodes = [i for i in range(len(qs) - 1) if qs[i + 1] - qs[i] == 1]
    if decodes:
        rows = torch.tensor([qs[i] for i in decodes], device=v.device)  # [B']
        slots = state_slots[decodes]
        state = ssm_state[slots]  # [B', Hv, Dk, Dv]
        out[rows] = recurrent_step(q[rows], k[rows], v[rows], g[rows], beta[rows], state)
        ssm_state[slots] = state
    chunks = [i for i in range(len(qs) - 1) if qs[i + 1] - qs[i] > 1]
    slot_ids = state_slots.tolist() if chunks else []
    for i in chunks:
        start, end, slot = qs[i], qs[i + 1], slot_ids[i]
        o, ssm_state[slot] = chunk_rule(q[start:end], k[start:end], v[start:end], g[start:end],
                                        beta[start:end], ssm_state[slot])
        out[start:end] = o
    return out


def recurrent_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """One token per row: q, k [B, H, Dk] (normalized), v [B, H, Dv], g, beta [B, H],
    state [B, H, Dk, Dv] (updated in place) → o [B, H, Dv]."""
    state.mul_(g.exp()[..., None, None])
    predicted = torch.einsum("bhkv,bhk->bhv", state, k)  # [B, H, Dv]: what S already says for k
    u = (v - predicted) * beta[..., None]  # [B, H, Dv]
    state.add_(k[..., :, None] * u[..., None, :])
    return torch.einsum("bhkv,bhk->bhv", state, q)


def recurrent_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request token by token (the definition; tests compare the chunked form to it):
    q, k [n, H, Dk] (normalized), v [n, H, Dv], g, beta [n, H], state [H, Dk, Dv]
    → (o [n, H, Dv], the state after the n tokens)."""
    state = state.clone()[None]  # [1, H, Dk, Dv]
    out = torch.stack([
        recurrent_step(q[t, None], k[t, None], v[t, None], g[t, None], beta[t, None], state)[0]
        for t in range(q.shape[0])
    ])
    return out, state[0]


def chunk_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request, CHUNK tokens at a time: q, k [n, H, Dk] (normalized, q scaled),
    v [n, H, Dv], g, beta [n, H] (float32), state [H, Dk, Dv] → (o [n, H, Dv], final state)."""
    n = q.shape[0]
    pad = -n % chunk
    # Padded tokens have k = v = beta = g = 0: they neither write nor decay the state.
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1) for x in (q, k, v))  # [H, n', D]
    g, beta = (F.pad(x, (0, 0, 0, pad)).t() for x in (g, beta))  # [H, n']
    h, total = g.shape
    c = total // chunk
    q, k, v = (x.reshape(h, c, chunk, x.shape[-1]) for x in (q, k, v))  # [H, c, C, D]
    g, beta = g.reshape(h, c, chunk), beta.reshape(h, c, chunk)  # [H, c, C]
    cum = g.cumsum(dim=-1)  # [H, c, C]: G_t, log of the decay from the chunk start to t
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()  # s <= t
    # decay[t, s] = exp(G_t - G_s) for s <= t (masked before exp: G_t - G_s > 0 above)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kb = k * beta[..., None]  # [H, c, C, Dk]
    # (I + A) with A strictly lower: A[t, s] = beta_t exp(G_t - G_s) k_t . k_s
    system = (kb @ k.transpose(-1, -2)) * decay  # [H, c, C, C]; its diagonal is ignored below
    rhs_v = v * beta[..., None]  # [H, c, C, Dv]
    rhs_s = kb * cum.exp()[..., None]  # [H, c, C, Dk]: how much each write reads the entry state
    w_v = torch.linalg.solve_triangular(system, rhs_v, upper=False, unitriangular=True)
    w_s = torch.linalg.solve_triangular(system, rhs_s, upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay  # [H, c, C, C]: q_t . k_s exp(G_t - G_s), s <= t
    q_decayed = q * cum.exp()[..., None]  # reads the entry state through G_t
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]  # decay from s to the chunk end
    s = state.float().clone()  # [H, Dk, Dv]
    out = torch.empty_like(v)  # [H, c, C, Dv]
    for i in range(c):
        u = w_v[:, i] - w_s[:, i] @ s  # [H, C, Dv]: the chunk's writes given its entry state
        out[:, i] = q_decayed[:, i] @ s + scores[:, i] @ u
        s = s * cum[:, i, -1].exp()[:, None, None] + k_to_end[:, i].transpose(-1, -2) @ u
    o = out.reshape(h, total, -1)[:, :n].transpose(0, 1)  # [n, H, Dv]
    return o, s
