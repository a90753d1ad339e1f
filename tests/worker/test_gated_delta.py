"""Gated DeltaNet's kernels and their memory: the torch reference against transformers' torch
fallbacks, the Triton kernels against the reference, and the KV cache's state region.

Triton tests run on CUDA, or on CPU with `TRITON_INTERPRET=1` and triton installed:
    TRITON_INTERPRET=1 .venv/bin/pytest tests/worker/test_gated_delta.py -q
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from worker.kv_cache import STATE_ALIGN, KVCache, KVShape, StateShape
from worker.model import gated_delta as ref
from worker.model import gated_delta_triton as tri

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_GPU = torch.cuda.is_available() and HAS_TRITON
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and HAS_TRITON
kernels = pytest.mark.skipif(not (HAS_GPU or INTERPRET),
                             reason="needs CUDA and triton (or TRITON_INTERPRET=1)")
DEVICE = "cuda" if HAS_GPU else "cpu"


def hf_functions():  # noqa: ANN201 - transformers' torch fallbacks (the equality target)
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    return m


def random_rule_inputs(n: int, hk: int, hv: int, dk: int, dv: int, seed: int = 0):  # noqa: ANN201
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(n, hk, dk, generator=gen), torch.randn(n, hk, dk, generator=gen)
    v = torch.randn(n, hv, dv, generator=gen)
    g = -torch.rand(n, hv, generator=gen) * 2  # log decay <= 0
    beta = torch.rand(n, hv, generator=gen)
    return q, k, v, g, beta


def batch_bounds(lengths: list[int]) -> tuple[torch.Tensor, list[int]]:
    qs = [0]
    for n in lengths:
        qs.append(qs[-1] + n)
    return torch.tensor(qs), qs


@pytest.mark.parametrize("n", [1, 7, 64, 150])
def test_chunked_rule_equals_transformers_chunked_and_recurrent(n: int) -> None:
    m = hf_functions()
    q, k, v, g, beta = random_rule_inputs(n, 2, 4, 16, 8)
    s0 = torch.randn(1, 4, 16, 8)
    kw = dict(g=g[None], beta=beta[None], initial_state=s0, output_final_state=True,
              use_qk_l2norm_in_kernel=True)
    want_o, want_s = m.torch_chunk_gated_delta_rule(q[None], k[None], v[None], **kw)
    rec_o, rec_s = m.torch_recurrent_gated_delta_rule(q[None], k[None], v[None], **kw)
    state = torch.zeros(3, 4, 16, 8)
    state[2] = s0[0]
    qs_t, qs = batch_bounds([n])
    got = ref.gated_delta_rule(q, k, v, g, beta, state, torch.tensor([2]), qs_t, qs)
    assert float((got - want_o[0]).abs().max()) < 1e-5
    assert float((state[2] - want_s[0]).abs().max()) < 1e-5
    assert float((got - rec_o[0]).abs().max()) < 1e-4  # the two forms agree too
    assert float((state[2] - rec_s[0]).abs().max()) < 1e-4
    assert float(state[[0, 1]].abs().max()) == 0.0  # other slots untouched


def test_decode_steps_equal_transformers_recurrent() -> None:
    m = hf_functions()
    q, k, v, g, beta = random_rule_inputs(20, 1, 3, 8, 8, seed=1)
    s0 = torch.randn(1, 3, 8, 8)
    want_o, want_s = m.torch_recurrent_gated_delta_rule(
        q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=s0,
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    state = s0.clone()
    qs_t, qs = batch_bounds([1])
    got = torch.cat([ref.gated_delta_rule(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1],
                                          beta[t : t + 1], state, torch.tensor([0]), qs_t, qs)
                     for t in range(20)])
    assert float((got - want_o[0]).abs().max()) < 1e-5
    assert float((state - want_s).abs().max()) < 1e-5


@pytest.mark.parametrize("splits", [[150], [1] * 12 + [138], [2, 3, 1, 60, 84], [100, 50]])
def test_conv_in_pieces_equals_transformers_conv(splits: list[int]) -> None:
    """Chunks shorter than the conv's K-1 history (2 < 3) mix old state and new inputs."""
    m = hf_functions()
    c, k = 12, 4
    x = torch.randn(1, c, sum(splits))
    w = torch.randn(c, k)
    want = m.causal_conv1d_fn(x, w, None, activation="silu")[0].t()  # [T, C]
    state = torch.zeros(2, k - 1, c)
    rows, pos = [], 0
    for n in splits:
        qs_t, qs = batch_bounds([n])
        piece = x[0].t()[pos : pos + n].contiguous()  # [n, C]
        rows.append(ref.causal_conv(piece, w, state, torch.tensor([1]), qs_t, qs))
        pos += n
    assert float((torch.cat(rows) - want).abs().max()) < 1e-5
    assert torch.equal(state[1], x[0].t()[-(k - 1) :])  # the state is the last K-1 inputs
    assert float(state[0].abs().max()) == 0.0


def mixed_batch(  # noqa: ANN201 - the step's tensors by name
    device: str, dtype: torch.dtype = torch.float32, dims: tuple[int, ...] = (2, 4, 16, 8),
    seed: int = 0,
):
    """A step of 6 requests: prefill chunks (one shorter than K-1), decodes, an empty one."""
    hk, hv, dk, dv = dims
    lengths = [5, 1, 70, 1, 0, 2]
    slots = torch.tensor([3, 0, 5, 1, 2, 6], device=device)
    t = sum(lengths)
    q, k, v, g, beta = random_rule_inputs(t, hk, hv, dk, dv, seed)
    cdim, ker = 2 * hk * dk + hv * dv, 4
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(t, cdim, generator=gen)
    w = torch.randn(cdim, ker, generator=gen) * 0.5
    conv0 = torch.randn(7, ker - 1, cdim, generator=gen)
    ssm0 = torch.randn(7, hv, dk, dv, generator=gen)
    move = lambda a: a.to(device)  # noqa: E731
    qs_t, qs = batch_bounds(lengths)
    named = dict(x=x, w=w, conv0=conv0, q=q, k=k, v=v)
    low = {name: move(a).to(dtype) for name, a in named.items()}
    return dict(**low, ssm0=move(ssm0), g=move(g), beta=move(beta), slots=slots,
                qs_t=qs_t.to(device), qs=qs)


OUTPUTS = ("conv out", "conv state", "rule out", "ssm state")


def run_mixed(ops, b: dict) -> tuple[torch.Tensor, ...]:  # noqa: ANN001
    conv, ssm = b["conv0"].clone(), b["ssm0"].clone()
    y = ops.causal_conv(b["x"], b["w"], conv, b["slots"], b["qs_t"], b["qs"])
    o = ops.gated_delta_rule(b["q"], b["k"], b["v"], b["g"], b["beta"], ssm, b["slots"], b["qs_t"],
                             b["qs"])
    return y, conv, o, ssm


def test_mixed_batch_equals_each_request_alone() -> None:
    b = mixed_batch("cpu")
    y, conv, o, ssm = run_mixed(ref, b)
    qs = b["qs"]
    for i, slot in enumerate(b["slots"].tolist()):
        s, e = qs[i], qs[i + 1]
        one = {**b, **{name: b[name][s:e] for name in ("x", "q", "k", "v", "g", "beta")},
               "slots": torch.tensor([slot]), "qs_t": torch.tensor([0, e - s]), "qs": [0, e - s]}
        y1, conv1, o1, ssm1 = run_mixed(ref, one)
        assert torch.allclose(y[s:e], y1, atol=1e-6) and torch.allclose(o[s:e], o1, atol=1e-5)
        assert torch.allclose(conv[slot], conv1[slot])
        assert torch.allclose(ssm[slot], ssm1[slot], atol=1e-5)
    # Slot 4 belongs to no request of the step: untouched.
    assert torch.equal(conv[4], b["conv0"][4]) and torch.equal(ssm[4], b["ssm0"][4])


@kernels
def test_triton_kernels_equal_the_reference() -> None:
    b = mixed_batch(DEVICE)
    want = run_mixed(ref, b)
    got = run_mixed(tri, b)
    for name, w, g in zip(OUTPUTS, want, got, strict=True):
        assert float((w - g).abs().max()) < 1e-4, name


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_at_qwen3_next_shapes_on_gpu(dtype: torch.dtype) -> None:
    """Qwen3-Next-80B's per-rank head shapes (16 key / 32 value heads of 128), bf16 inputs."""
    b = mixed_batch("cuda", dtype, dims=(16, 32, 128, 128), seed=3)
    want = run_mixed(ref, {**b, **{k: b[k].float() for k in ("x", "w", "conv0", "q", "k", "v")}})
    got = run_mixed(tri, b)
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    for name, w, g in zip(OUTPUTS, want, got, strict=True):
        scale = max(1.0, float(w.abs().max()))
        assert float((w.float() - g.float()).abs().max()) < tol * scale, name


# ---- the state region of the KV cache ----------------------------------------------------------
def state_shape_for_test() -> KVShape:
    state = StateShape(conv=(3, 10), ssm=(2, 4, 3), conv_dtype=torch.bfloat16)  # 60 B + 96 B
    return KVShape(num_pages=5, num_layers=4, num_kv_heads=2, page_size=4, head_dim=8,
                   dtype=torch.bfloat16, state_layers=(0, 2, 3), state=state, num_state_slots=6)


def test_state_region_layout_is_slot_major_after_the_pages() -> None:
    shape = state_shape_for_test()
    kv = KVCache(shape)
    assert shape.num_full_layers == 1  # only layer 1 has pages
    assert kv.data.shape == (5, 1, 2, 2, 4, 8)
    assert shape.state.layer_bytes == 64 + 128  # conv 60 B → 64, ssm 96 B → 128 (STATE_ALIGN)
    assert shape.state_slot_bytes == 3 * shape.state.layer_bytes
    assert shape.state_base % STATE_ALIGN == 0 and shape.state_base >= 5 * shape.page_bytes
    assert kv.nbytes() == shape.state_base + 6 * shape.state_slot_bytes
    base = kv.data_ptr() + shape.state_base
    for i, layer in enumerate((0, 2, 3)):
        conv, ssm = kv.state(layer)
        assert conv.shape == (6, 3, 10) and conv.dtype == torch.bfloat16
        assert ssm.shape == (6, 2, 4, 3) and ssm.dtype == torch.float32
        # Slot s of layer i sits inside slot s's byte range: a slot is one contiguous range.
        for s in (0, 5):
            start = base + s * shape.state_slot_bytes + i * shape.state.layer_bytes
            assert conv[s].data_ptr() == start and ssm[s].data_ptr() == start + 64
    # Writing every view fills the slots without touching the pages.
    for layer in (0, 2, 3):
        conv, ssm = kv.state(layer)
        conv.fill_(1.0)
        ssm.fill_(2.0)
    assert float(kv.data.abs().max()) == 0.0


def test_zero_and_copy_state_move_whole_slots() -> None:
    kv = KVCache(state_shape_for_test())
    for layer in (0, 2, 3):
        conv, ssm = kv.state(layer)
        conv.copy_(torch.randn(conv.shape))
        ssm.copy_(torch.randn(ssm.shape))
    before = [tuple(t.clone() for t in kv.state(layer)) for layer in (0, 2, 3)]
    kv.copy_state(torch.tensor([1, 4]), torch.tensor([3, 0]))
    kv.zero_state(torch.tensor([5]))
    for (conv0, ssm0), layer in zip(before, (0, 2, 3), strict=True):
        conv, ssm = kv.state(layer)
        assert torch.equal(conv[3], conv0[1]) and torch.equal(ssm[0], ssm0[4])
        assert torch.equal(conv[2], conv0[2])  # not a destination: unchanged
        assert float(conv[5].abs().max()) == 0.0 and float(ssm[5].abs().max()) == 0.0


def test_plan_state_copies_apply_in_order() -> None:
    """(src, dst) pairs as the cache manager hands them to the runner; src -1 zeroes dst."""
    kv = KVCache(state_shape_for_test())
    kv.state_region.copy_(torch.randint(1, 255, kv.state_region.shape, dtype=torch.uint8))
    before = kv.state_region.clone()
    kv.apply_state_copies([(2, 0), (-1, 2), (2, 4)])  # 0 <- old 2; 2 <- zeros; 4 <- new 2 (zeros)
    assert torch.equal(kv.state_region[0], before[2])
    assert int(kv.state_region[2].max()) == 0 and int(kv.state_region[4].max()) == 0
    assert torch.equal(kv.state_region[[1, 3, 5]], before[[1, 3, 5]])


def test_state_and_page_views_refuse_the_other_kind_of_layer() -> None:
    kv = KVCache(state_shape_for_test())
    with pytest.raises(ValueError, match="recurrent layer"):
        kv.layer(2)
    with pytest.raises(ValueError, match="no state slot"):
        kv.state(1)
    with pytest.raises(ValueError, match="state_layers needs KVShape.state"):
        KVShape(num_pages=1, num_layers=2, num_kv_heads=1, page_size=4, head_dim=8,
                dtype=torch.float32, state_layers=(0,))


def test_models_without_state_keep_their_exact_allocation() -> None:
    shape = KVShape(num_pages=7, num_layers=3, num_kv_heads=2, page_size=4, head_dim=8,
                    dtype=torch.float16)
    kv = KVCache(shape)
    assert kv.nbytes() == 7 * shape.page_bytes and kv.data.dtype == torch.float16
    assert kv.state_region.shape == (0, 0)
