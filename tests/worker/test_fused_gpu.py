"""The fused Triton kernels (worker/model/fused.py) against the torch reference they replace,
an engine running them against the unfused engine, and dummy weights drawn on the GPU.

Kernel tests run on CUDA; with `TRITON_INTERPRET=1` and triton installed they also run on CPU
tensors through Triton's interpreter (how the kernels were debugged without a GPU). Outputs
start NaN-poisoned and inputs are strided views with NaN padding, so a kernel that skips an
element or reads past its row fails.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from worker.arch.hf_config import RopeConfig
from worker.model import fused, fused_rope
from worker.model.layers import RMSNorm
from worker.model.rope import RotaryEmbedding, apply_rope

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_GPU = torch.cuda.is_available() and HAS_TRITON
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and HAS_TRITON
DEVICE = "cuda" if HAS_GPU else "cpu"
kernels = pytest.mark.skipif(
    not (HAS_GPU or INTERPRET), reason="needs CUDA and triton (or TRITON_INTERPRET=1)"
)
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs CUDA and triton")
DTYPES = [torch.bfloat16, torch.float16]


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def _strided(
    rows: int, cols: int, dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0
) -> torch.Tensor:
    """Random [rows, cols] as a view into a wider NaN-padded buffer (row stride cols + 7)."""
    buf = torch.full((rows, cols + 7), float("nan"), dtype=dtype)
    buf[:, :cols] = (torch.randn(rows, cols, generator=gen) * scale).to(dtype)
    return buf.to(DEVICE)[:, :cols]


def _poisoned(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def _norm(hidden: int, dtype: torch.dtype, gen: torch.Generator) -> RMSNorm:
    norm = RMSNorm(hidden, 1e-6, dtype)
    with torch.no_grad():
        norm.weight.copy_(
            (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
        )  # not all ones: it matters
    return norm.to(DEVICE)


# ---- CPU: the reference stays the CPU path ---------------------------------------------------
def test_fused_kernels_are_off_on_cpu(tiny_checkpoint) -> None:
    from worker.config import ModelConfig, ParallelConfig
    from worker.model.loader import load_model

    assert not fused.available("cpu")
    path, _ = tiny_checkpoint("qwen3")
    model, _ = load_model(ModelConfig(path=str(path)), ParallelConfig())
    flags = [m.fused for m in model.modules() if hasattr(m, "fused")]
    assert flags and not any(flags)  # norms, attention, MLPs: all on the torch reference
    model.set_fused_kernels(True)  # type: ignore[operator]
    assert all(m.fused for m in model.modules() if hasattr(m, "fused"))


# ---- kernels against the torch reference ----------------------------------------------------
@pytest.mark.gpu
@kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(1, 4096), (3, 96), (17, 64), (129, 5120)])
def test_rms_norm_and_add_rms_norm_match_reference(
    dtype: torch.dtype, tokens: int, hidden: int
) -> None:
    gen = torch.Generator().manual_seed(tokens * hidden)
    norm = _norm(hidden, dtype, gen)
    x = _strided(tokens, hidden, dtype, gen)
    residual = _strided(tokens, hidden, dtype, gen, scale=4.0)
    with torch.no_grad():
        ref = norm(x)  # fused is off: the torch reference
        ref_out, ref_res = norm.add_norm(x, residual)

    out = fused.rms_norm(x, norm.weight, norm.eps, out=_poisoned(tokens, hidden, dtype=dtype))
    assert torch.isfinite(out).all() and _rel(out, ref) < 1e-2
    out, res = fused.add_rms_norm(
        x,
        residual,
        norm.weight,
        norm.eps,
        out=_poisoned(tokens, hidden, dtype=dtype),
        residual_out=_poisoned(tokens, hidden, dtype=dtype),
    )
    if (
        INTERPRET and dtype == torch.bfloat16
    ):  # the interpreter truncates float32 → bf16 instead of rounding
        assert _rel(res, ref_res) < 1e-2
    else:
        assert torch.equal(res, ref_res)  # one rounded add, exactly the reference's
    assert torch.isfinite(out).all() and _rel(out, ref_out) < 1e-2
    norm.fused = True  # the module's own fused path gives the same
    o2, r2 = norm.add_norm(x, residual)
    assert (
        torch.equal(o2, out)
        and torch.equal(r2, res)
        and torch.equal(norm(x), fused.rms_norm(x, norm.weight, 1e-6))
    )


@pytest.mark.gpu
@kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 12288), (5, 96), (33, 1000)])
def test_silu_mul_matches_reference(dtype: torch.dtype, tokens: int, inter: int) -> None:
    gen = torch.Generator().manual_seed(inter + tokens)
    gate_up = _strided(tokens, 2 * inter, dtype, gen, scale=3.0)
    gate, up = gate_up.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    out = fused.silu_mul(gate_up, out=_poisoned(tokens, inter, dtype=dtype))
    assert torch.isfinite(out).all() and _rel(out, ref) < 1e-2


ROPES = {
    "default": RopeConfig("default", 1e6),
    "linear": RopeConfig("linear", 1e4, factor=4.0),
    "llama3": RopeConfig("llama3", 5e5, factor=8.0, original_max_position_embeddings=8192),
    "yarn": RopeConfig(
        "yarn", 1e6, factor=4.0, original_max_position_embeddings=32768
    ),  # cos/sin scaled
    "dynamic": RopeConfig("dynamic", 1e4, factor=2.0, max_position_embeddings=2048),
}


@pytest.mark.gpu
@kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize(
    "tokens,hq,hkv,head_dim", [(1, 32, 8, 128), (7, 6, 2, 32), (65, 4, 1, 64), (3, 5, 5, 16)]
)
def test_qk_norm_rope_matches_reference(
    dtype: torch.dtype, rope: str, qk_norm: bool, tokens: int, hq: int, hkv: int, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(tokens * 1000 + hq * 10 + hkv)
    width = (hq + 2 * hkv) * head_dim
    qkv = _strided(
        tokens, width, dtype, gen, scale=2.0
    )  # [T, (Hq + 2 Hkv) * D], NaN padding after each row
    positions = torch.randint(0, 20000, (tokens,), generator=gen)
    seq_lens = (
        positions + 1 + torch.randint(0, 3000, (tokens,), generator=gen)
    )  # dynamic: each token's request
    emb = RotaryEmbedding(ROPES[rope], head_dim, DEVICE)
    cos, sin = emb.cos_sin(positions.to(DEVICE), seq_lens.to(DEVICE))  # [T, D] float32
    q_norm = _norm(head_dim, dtype, gen) if qk_norm else None
    k_norm = _norm(head_dim, dtype, gen) if qk_norm else None

    q_size, kv_size = hq * head_dim, hkv * head_dim
    q = qkv[:, :q_size].reshape(tokens, hq, head_dim)
    k = qkv[:, q_size : q_size + kv_size].reshape(tokens, hkv, head_dim)
    with torch.no_grad():
        if q_norm is not None and k_norm is not None:
            q, k = q_norm(q), k_norm(k)
        ref_q, ref_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    v_before = qkv[:, q_size + kv_size :].clone()
    row_pad = qkv.as_strided(
        (tokens, 7), (qkv.stride(0), 1), qkv.storage_offset() + width
    )  # the NaN padding

    fused_rope.qk_norm_rope(
        qkv,
        hq,
        hkv,
        cos,
        sin,
        None if q_norm is None else q_norm.weight,
        None if k_norm is None else k_norm.weight,
        1e-6,
    )
    got_q = qkv[:, :q_size].reshape(tokens, hq, head_dim)
    got_k = qkv[:, q_size : q_size + kv_size].reshape(tokens, hkv, head_dim)
    assert torch.isfinite(got_q).all() and torch.isfinite(got_k).all()
    assert _rel(got_q, ref_q) < 1e-2 and _rel(got_k, ref_k) < 1e-2
    assert torch.equal(qkv[:, q_size + kv_size :], v_before)  # v untouched
    assert torch.isnan(row_pad).all()  # nothing written past the row


@pytest.mark.gpu
@kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(  # up to FEW_TOKENS tokens 2 heads a program, past it 8
    "tokens,hq,hkv,head_dim", [(1, 32, 8, 128), (7, 6, 2, 32), (3, 5, 5, 16), (12, 8, 4, 128)]
)
def test_qk_norm_rope_stores_k_and_v_in_their_slots(
    dtype: torch.dtype, tokens: int, hq: int, hkv: int, head_dim: int
) -> None:
    """With kv_cache, the same kernel writes the rotated k and the untouched v of each token to
    its slot, exactly what attention.store_kv writes after the unfused ops; a -1 slot (graph
    padding) writes nothing and no other slot changes."""
    from worker.model.attention import store_kv

    gen = torch.Generator().manual_seed(tokens * 100 + hq)
    qkv = _strided(tokens, (hq + 2 * hkv) * head_dim, dtype, gen, scale=2.0)
    positions = torch.randint(0, 4000, (tokens,), generator=gen)
    cos, sin = RotaryEmbedding(ROPES["default"], head_dim, DEVICE).cos_sin(positions.to(DEVICE))
    q_norm, k_norm = _norm(head_dim, dtype, gen), _norm(head_dim, dtype, gen)
    pages, page_size = 6, 4
    slots = torch.randperm(pages * page_size, generator=gen)[:tokens]
    slots[tokens // 2] = -1  # a padding row
    slots = slots.to(DEVICE)
    k_cache = torch.full(
        (pages, hkv, page_size, head_dim), float("nan"), dtype=dtype, device=DEVICE
    )
    v_cache = k_cache.clone()
    want_k, want_v = k_cache.clone(), v_cache.clone()
    ref = qkv.clone()
    fused_rope.qk_norm_rope(
        ref, hq, hkv, cos, sin, q_norm.weight, k_norm.weight, 1e-6
    )  # then the store kernel's job:
    k_ref = ref[:, hq * head_dim : (hq + hkv) * head_dim].reshape(tokens, hkv, head_dim)
    v_ref = ref[:, (hq + hkv) * head_dim :].reshape(tokens, hkv, head_dim)
    keep = slots >= 0
    store_kv(k_ref[keep], v_ref[keep], want_k, want_v, slots[keep])

    fused_rope.qk_norm_rope(
        qkv,
        hq,
        hkv,
        cos,
        sin,
        q_norm.weight,
        k_norm.weight,
        1e-6,
        kv_cache=(k_cache, v_cache, slots),
    )
    assert torch.equal(qkv, ref)  # q, k rotated as before; v untouched
    assert torch.equal(k_cache.isnan(), want_k.isnan()) and torch.equal(
        v_cache.isnan(), want_v.isnan()
    )
    assert torch.equal(k_cache.nan_to_num(), want_k.nan_to_num()) and torch.equal(
        v_cache.nan_to_num(), want_v.nan_to_num()
    )


@pytest.mark.gpu
@kernels
def test_kernels_refuse_wrong_shapes_clearly() -> None:
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight has shape"):
        fused.rms_norm(x, torch.ones(4, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="even width"):
        fused.silu_mul(torch.zeros(2, 7, device=DEVICE))
    cos = torch.zeros(2, 4, device=DEVICE)
    with pytest.raises(ValueError, match="qkv must be"):
        fused_rope.qk_norm_rope(torch.zeros(2, 10, device=DEVICE), 1, 1, cos, cos)
    with pytest.raises(ValueError, match="out must be"):
        fused.rms_norm(x, torch.ones(8, device=DEVICE), 1e-6, out=torch.zeros(2, 4, device=DEVICE))
    cache = torch.zeros(3, 2, 4, 2, device=DEVICE)  # 2 kv heads where the qkv has 1
    with pytest.raises(ValueError, match="kv_cache must be"):
        fused_rope.qk_norm_rope(
            torch.zeros(2, 12, device=DEVICE),
            1,
            1,
            cos,
            cos,
            kv_cache=(cache, cache, torch.zeros(2, dtype=torch.int64, device=DEVICE)),
        )


# ---- whole engines on a GPU ------------------------------------------------------------------
@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_fused_engine_serves_the_unfused_greedy_tokens(tmp_path: Path, family: str) -> None:
    from tests.worker.test_engine import generate
    from tests.worker.test_gpu import tiny_gpu_engine_setup
    from worker.engine import Engine

    config, prompts = tiny_gpu_engine_setup(tmp_path / family, family, seed=1)
    unfused = Engine(config)
    unfused.model.set_fused_kernels(False)  # type: ignore[operator]  # the torch reference, eager
    want = generate(unfused, prompts, max_tokens=24)

    one = generate(unfused, prompts[:1], max_tokens=24)  # decode at batch 1 ...
    eager = Engine(config)
    assert (
        eager.model.model.norm.fused and eager.model.model.layers[0].mlp.fused
    )  # the loader's choice on CUDA
    assert eager.model.single_token_gemv  # ... runs the layers as GEMVs (worker/model/gemv.py)
    assert generate(eager, prompts, max_tokens=24) == want
    assert generate(eager, prompts[:1], max_tokens=24) == one
    graphed = Engine(config)
    graphed.runner.enable_cuda_graphs(8, 128)
    assert generate(graphed, prompts, max_tokens=24) == want
    assert generate(graphed, prompts[:1], max_tokens=24) == one
    assert (
        graphed.runner.decode_graphs is not None and graphed.runner.decode_graphs.num_replays > 20
    )


@pytest.mark.gpu
@gpu
def test_dummy_weights_are_drawn_on_the_gpu_seeded(tmp_path: Path) -> None:
    import json

    from worker.config import ModelConfig, ParallelConfig
    from worker.model.loader import load_model

    cfg = {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 1000,
        "max_position_embeddings": 512,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))

    def load(seed: int):
        return load_model(
            ModelConfig(path=str(tmp_path), load_format="dummy", seed=seed),
            ParallelConfig(device="cuda"),
        )

    model, spec = load(7)
    assert spec.fingerprint == "dummy:7:cuda"  # not the CPU draw of seed 7: must not pair with it
    assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in model.parameters())
    assert torch.all(model.model.norm.weight == 1) and torch.all(
        model.model.layers[0].self_attn.q_norm.weight == 1
    )
    w = model.model.layers[1].mlp.gate_up_proj.weight.float()
    assert abs(float(w.mean())) < 1e-3 and 0.019 < float(w.std()) < 0.021
    again, _ = load(7)
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True)
    )
    other, _ = load(8)
    assert not torch.equal(other.model.embed_tokens.weight, model.model.embed_tokens.weight)
