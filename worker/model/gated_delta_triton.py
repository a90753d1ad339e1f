"""Triton kernels for Gated DeltaNet (CUDA): the causal conv and the gated delta rule.

Same contract as the torch reference (worker/model/gated_delta.py): a step's flattened tokens,
request after request, each request's state in its slot of the state region, read at the start
and left advanced at the end. One launch covers a whole mixed batch (prefill chunks and
decodes alike); a decode is a chunk of one token.

- `causal_conv`: one program per (token, channel block) computes SiLU(sum_j w_j x_{t-K+1+j}),
  reading inputs before the chunk from the conv state; a second launch, one program per
  (request, channel block), then shifts the request's last K-1 inputs into its state (after
  every read of the old state is done).
- `gated_delta_rule`: one program per (request, value head, block of BV value dims) holds its
  [Dk, BV] slice of the float32 state in registers and walks the request's tokens in order
  (the recurrence itself: q, k l2-normalized and q scaled in-kernel, value head h reads key
  head h // rep), writing o_t per token and the state once at the end. Decode is one step;
  a prefill chunk of n tokens is n sequential steps per program — exact, but a chunked kernel
  (flash-linear-attention's `chunk_gated_delta_rule`) is the faster choice for long prefills.

Triton is imported on first use, so importing this module costs nothing on CPU; with
`TRITON_INTERPRET=1` the kernels run on CPU tensors (tests/worker/test_gated_delta.py).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

_CONV_BLOCK = 256  # channels per conv program
_STATE_BV = 32  # value dims per delta-rule program: a [128, 32] float32 state slice in registers


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit
    def conv_out_kernel(
        x_ptr, w_ptr, state_ptr, tok_req_ptr, qs_ptr, slots_ptr, out_ptr,
        num_channels, stride_xt, stride_ss, stride_sk, stride_ot,
        K: tl.constexpr, BLOCK: tl.constexpr,
    ):
        t = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        cmask = c < num_channels
        req = tl.load(tok_req_ptr + t)
        start = tl.load(qs_ptr + req)
        slot = tl.load(slots_ptr + req)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            # The input this tap reads, per lane (masks are built from vectors, not scalars).
            src = tl.zeros([BLOCK], dtype=tl.int64) + (t - (K - 1) + j)
            in_chunk = src >= start
            # Before the chunk: the state holds inputs start-(K-1) .. start-1 at rows 0 .. K-2.
            row = tl.maximum(K - 1 - (start - src), 0)
            xv = tl.load(x_ptr + tl.maximum(src, 0) * stride_xt + c, mask=cmask & in_chunk,
                         other=0.0)
            sv = tl.load(state_ptr + slot * stride_ss + row * stride_sk + c,
                         mask=cmask & (src < start), other=0.0)
            w = tl.load(w_ptr + c * K + j, mask=cmask, other=0.0)
            acc += (xv.to(tl.float32) + sv.to(tl.float32)) * w.to(tl.float32)
        y = acc * tl.sigmoid(acc)  # SiLU
        tl.store(out_ptr + t * stride_ot + c, y.to(out_ptr.dtype.element_ty), mask=cmask)

    @triton.jit
    def conv_state_kernel(
        x_ptr, state_ptr, qs_ptr, slots_ptr, num_channels, stride_xt, stride_ss, stride_sk,
        K: tl.constexpr, BLOCK: tl.constexpr,
    ):
        req = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        cmask = c < num_channels
        start = tl.load(qs_ptr + req)
        end = tl.load(qs_ptr + req + 1)
        n = end - start
        base = state_ptr + tl.load(slots_ptr + req) * stride_ss
        # New row j = input end-(K-1)+j: from the chunk, or old row j+n (> j: not yet overwritten).
        for j in tl.static_range(K - 1):
            src = tl.zeros([BLOCK], dtype=tl.int64) + (end - (K - 1) + j)
            in_chunk = src >= start
            xv = tl.load(x_ptr + tl.maximum(src, 0) * stride_xt + c, mask=cmask & in_chunk,
                         other=0.0)
            old = tl.load(base + tl.minimum(j + n, K - 2) * stride_sk + c,
                          mask=cmask & (src < start), other=0.0)
            val = tl.where(in_chunk, xv.to(tl.float32), old.to(tl.float32))
            tl.store(base + j * stride_sk + c, val.to(state_ptr.dtype.element_ty), mask=cmask)

    @triton.jit
    def delta_rule_kernel(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, qs_ptr, slots_ptr, out_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt,
        stride_ss, stride_sh, stride_sk, stride_ot, stride_oh,
        head_k_dim, head_v_dim, scale,
        REP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    ):
        req = tl.program_id(0)
        h = tl.program_id(1)
        hk = h // REP  # the key head this value head reads
        offs_k = tl.arange(0, BK)
        offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
        mk, mv = offs_k < head_k_dim, offs_v < head_v_dim
        start = tl.load(qs_ptr + req)
        end = tl.load(qs_ptr + req + 1)
        s_ptrs = (state_ptr + tl.load(slots_ptr + req) * stride_ss + h * stride_sh
                  + offs_k[:, None] * stride_sk + offs_v[None, :])
        smask = mk[:, None] & mv[None, :]
        s = tl.load(s_ptrs, mask=smask, other=0.0).to(tl.float32)  # [BK, BV]
        for t in range(start, end):
            q = tl.load(q_ptr + t * stride_qt + hk * stride_qh + offs_k, mask=mk, other=0.0)
            k = tl.load(k_ptr + t * stride_kt + hk * stride_kh + offs_k, mask=mk, other=0.0)
            v = tl.load(v_ptr + t * stride_vt + h * stride_vh + offs_v, mask=mv, other=0.0)
            q, k, v = q.to(tl.float32), k.to(tl.float32), v.to(tl.float32)
            q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
            g = tl.load(g_ptr + t * stride_gt + h)
            beta = tl.load(beta_ptr + t * stride_gt + h)
            s = s * tl.exp(g)
            u = (v - tl.sum(s * k[:, None], axis=0)) * beta  # [BV]: the correction it writes
            s = s + k[:, None] * u[None, :]
            o = tl.sum(s * q[:, None], axis=0)  # [BV]
            tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_v, o, mask=mv)
        tl.store(s_ptrs, s, mask=smask)

    return SimpleNamespace(conv_out=conv_out_kernel, conv_state=conv_state_kernel,
                           delta_rule=delta_rule_kernel)


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, state_slots: torch.Tensor,
    query_start: torch.Tensor, query_start_list: list[int],
) -> torch.Tensor:
    """x [T, C], weight [C, K], conv_state [num_slots, K-1, C] (advanced in place), state_slots
    [B], query_start [B+1] (on x's device) → SiLU(causal conv) [T, C] in x's dtype."""
    t, c = x.shape
    k = weight.shape[1]
    b = len(query_start_list) - 1
    out = torch.empty_like(x)
    if t == 0:
        return out
    x = x.contiguous()
    weight = weight.contiguous()
    assert conv_state.stride(2) == 1, "conv state rows must be contiguous over channels"
    counts = query_start[1:] - query_start[:-1]  # [B]
    tok_req = torch.repeat_interleave(torch.arange(b, device=x.device), counts, output_size=t)
    kern = _kernels()
    blocks = -(-c // _CONV_BLOCK)
    kern.conv_out[(t, blocks)](
        x, weight, conv_state, tok_req, query_start, state_slots, out, c, x.stride(0),
        conv_state.stride(0), conv_state.stride(1), out.stride(0), K=k, BLOCK=_CONV_BLOCK)
    kern.conv_state[(b, blocks)](
        x, conv_state, query_start, state_slots, c, x.stride(0), conv_state.stride(0),
        conv_state.stride(1), K=k, BLOCK=_CONV_BLOCK)
    return out


def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    ssm_state: torch.Tensor, state_slots: torch.Tensor, query_start: torch.Tensor,
    query_start_list: list[int],
) -> torch.Tensor:
    """q, k [T, Hk, Dk] (raw), v [T, Hv, Dv], g, beta [T, Hv] float32, ssm_state
    [num_slots, Hv, Dk, Dv] float32 (advanced in place) → o [T, Hv, Dv] float32."""
    t, hv, dv = v.shape
    dk = q.shape[-1]
    out = torch.empty(t, hv, dv, dtype=torch.float32, device=v.device)
    b = len(query_start_list) - 1
    if t == 0 or b == 0:
        return out
    assert ssm_state.dtype == torch.float32 and ssm_state.stride(3) == 1
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    g, beta = g.contiguous(), beta.contiguous()
    grid = (b, hv, -(-dv // _STATE_BV))
    _kernels().delta_rule[grid](
        q, k, v, g, beta, ssm_state, query_start, state_slots, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2), out.stride(0), out.stride(1),
        dk, dv, dk**-0.5, REP=hv // q.shape[1], BK=_next_pow2(dk), BV=_STATE_BV)
    return out
