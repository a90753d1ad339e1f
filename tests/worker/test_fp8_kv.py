"""FP8 KV cache on the CPU reference (worker/model/fp8.py, attention.py): stored e4m3 and
dequantized on read, checkpoint K/V scales (per tensor, per head, the old single kv_scale) or
1.0, the config key, the KV pool's bytes, and an engine serving from FP8 pages."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.worker.conftest import PagedHarness
from worker.arch import fp8_config
from worker.cache_layout import kv_shape
from worker.config import CacheConfig, ConfigError, ModelConfig, ParallelConfig, WorkerConfig
from worker.kv_cache import KVCache, KVShape
from worker.model import fp8
from worker.model.attention import TorchSDPABackend, paged_attention, store_kv
from worker.model.loader import load_model

EMBEDDED = Path(__file__).resolve().parents[2] / "models" / "tandem-arith"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_quantize_round_trip_and_saturation() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 2, 32, generator=g) * 3
    scale = torch.tensor([0.5, 2.0])
    q = fp8.quantize_kv(x, scale)
    assert q.dtype == torch.float8_e4m3fn
    back = fp8.dequantize_kv(q.transpose(0, 1), scale, torch.float32).transpose(0, 1)
    assert _rel(back, x) < 0.04  # e4m3 keeps 3 mantissa bits: ≤ 1/16 relative per element
    huge = fp8.quantize_kv(torch.full((1, 2, 4), 1e6), torch.ones(2))
    assert bool((huge.float() == fp8.FP8_MAX).all())  # saturates, never inf/NaN


def test_config_key_is_validated() -> None:
    CacheConfig(kv_cache_dtype="fp8_e4m3").validate()
    with pytest.raises(ConfigError, match=r"cache.kv_cache_dtype must be one of auto\|fp8_e4m3"):
        CacheConfig(kv_cache_dtype="fp8").validate()  # type: ignore[arg-type]


def _fp8_cache(
    num_pages: int, heads: int, page: int, dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_pages, heads, page, dim)
    return torch.zeros(shape, dtype=fp8.FP8), torch.zeros(shape, dtype=fp8.FP8)


def test_reference_attention_reads_fp8_pages_as_float32() -> None:
    """Mixed step (a prompt chunk and two decodes) over e4m3 pages with per-head scales equals
    attention over the dequantized values exactly, and the float32 cache within e4m3 error."""
    from worker.batch import ForwardBatch

    g = torch.Generator().manual_seed(1)
    hq, hkv, d, page = 4, 2, 16, 4
    lens, news = [9, 5, 6], [9, 1, 1]  # a fresh prompt, then two one-token decodes
    scales = (torch.tensor([0.05, 0.2]), torch.tensor([0.1, 0.03]))
    k_cache, v_cache = _fp8_cache(16, hkv, page, d)
    k_ref, v_ref = torch.zeros(16, hkv, page, d), torch.zeros(16, hkv, page, d)
    tables = [[3, 7, 1], [4, 9], [12, 2]]
    # History of the decodes: already in the caches (stored as the store would store it).
    for i, (n, new) in enumerate(zip(lens, news, strict=True)):
        hist = n - new
        if hist:
            slots = torch.tensor([tables[i][p // page] * page + p % page for p in range(hist)])
            k, v = torch.randn(hist, hkv, d, generator=g), torch.randn(hist, hkv, d, generator=g)
            store_kv(k, v, k_cache, v_cache, slots, scales)
            store_kv(k, v, k_ref, v_ref, slots)
    t = sum(news)
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
    slot = [
        tables[i][p // page] * page + p % page
        for i, (n, new) in enumerate(zip(lens, news, strict=True))
        for p in range(n - new, n)
    ]
    table = torch.zeros(3, 3, dtype=torch.int64)
    for i, tb in enumerate(tables):
        table[i, : len(tb)] = torch.tensor(tb)
    qs = [0, 9, 10, 11]
    batch = ForwardBatch(
        input_ids=torch.zeros(t, dtype=torch.int64),
        positions=torch.zeros(t, dtype=torch.int64),
        query_start=torch.tensor(qs),
        seq_lens=torch.tensor(lens),
        page_table=table,
        slot_mapping=torch.tensor(slot),
        logits_indices=torch.tensor([8, 9, 10]),
        query_start_list=qs,
        seq_lens_list=lens,
    )
    out = paged_attention(q, k, v, k_cache, v_cache, batch, d**-0.5, kv_scales=scales)
    # The same step over float32 caches holding the dequantized FP8 values (this step's K/V
    # included, as stored): the same math, so the same numbers.
    k_deq = k_cache.float() * scales[0][None, :, None, None]
    v_deq = v_cache.float() * scales[1][None, :, None, None]
    exact = TorchSDPABackend().forward(q, k, v, k_deq, v_deq, batch, d**-0.5, kv_stored=True)
    plain = paged_attention(q, k, v, k_ref, v_ref, batch, d**-0.5)  # float32 pages
    assert out.dtype == q.dtype
    assert torch.allclose(out, exact, atol=1e-6, rtol=0)
    assert 0 < _rel(out, plain) < 0.05  # e4m3's rounding, nothing more


def _with_kv_scales(dst: Path, k: torch.Tensor, v: torch.Tensor, legacy: bool = False) -> Path:
    """A copy of the embedded model with K/V cache scales in its safetensors."""
    shutil.copytree(EMBEDDED, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for layer in range(4):
        p = f"model.layers.{layer}.self_attn"
        if legacy:
            tensors[f"{p}.kv_scale"] = k.clone()
        else:
            tensors[f"{p}.k_scale"], tensors[f"{p}.v_scale"] = k.clone(), v.clone()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_kv_scales_from_the_checkpoint(tmp_path: Path) -> None:
    model, spec = load_model(ModelConfig(path=str(EMBEDDED)), ParallelConfig())
    assert spec.kv_scales == "1.0"  # none in the checkpoint: 1.0, and said so
    attn = model.model.layers[0].self_attn  # type: ignore[union-attr, index]
    assert torch.equal(attn.k_scale, torch.ones(2)) and torch.equal(attn.v_scale, torch.ones(2))

    per_head = _with_kv_scales(
        tmp_path / "heads", torch.tensor([0.02, 0.05]), torch.tensor([0.03, 0.01])
    )
    model, spec = load_model(ModelConfig(path=str(per_head)), ParallelConfig())
    assert spec.kv_scales.startswith("checkpoint per-head sha256:")
    attn = model.model.layers[3].self_attn  # type: ignore[union-attr, index]
    assert torch.equal(attn.k_scale, torch.tensor([0.02, 0.05])) and torch.equal(
        attn.v_scale, torch.tensor([0.03, 0.01])
    )

    legacy = _with_kv_scales(
        tmp_path / "legacy", torch.tensor(0.04), torch.tensor(0.0), legacy=True
    )
    model, spec = load_model(ModelConfig(path=str(legacy)), ParallelConfig())
    attn = model.model.layers[1].self_attn  # type: ignore[union-attr, index]
    assert spec.kv_scales.startswith("checkpoint per-tensor")
    assert torch.equal(attn.k_scale, torch.full((2,), 0.04)) and torch.equal(
        attn.v_scale, attn.k_scale
    )

    # The contract label differs with the values: prefill and decode with other scales refuse to
    # pair.
    other = _with_kv_scales(
        tmp_path / "other", torch.tensor([0.02, 0.06]), torch.tensor([0.03, 0.01])
    )
    assert (
        load_model(ModelConfig(path=str(other)), ParallelConfig())[1].kv_scales
        != load_model(ModelConfig(path=str(per_head)), ParallelConfig())[1].kv_scales
    )


def test_bad_kv_scales_are_refused_naming_the_tensor() -> None:
    scales = fp8.KVScales(num_layers=2, num_kv_heads=4)
    with pytest.raises(
        fp8_config.Fp8Error, match=r"model.layers.1.self_attn.k_scale: .* one per kv head \(4\)"
    ):
        scales.add("model.layers.1.self_attn.k_scale", torch.ones(3))
    with pytest.raises(fp8_config.Fp8Error, match="finite and > 0"):
        scales.add("model.layers.0.self_attn.v_proj.v_scale", torch.tensor(0.0))
    scales.add("model.layers.0.self_attn.k_proj.k_scale", torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert torch.equal(scales.local("k", 0, [2, 3]), torch.tensor([3.0, 4.0]))  # a TP rank's heads
    assert torch.equal(scales.local("v", 0, [0]), torch.ones(1))  # absent: 1.0


def test_kv_pool_is_one_byte_per_element(tmp_path: Path) -> None:
    _, spec = load_model(ModelConfig(path=str(EMBEDDED)), ParallelConfig())
    auto = kv_shape(spec, WorkerConfig(cache=CacheConfig(max_total_tokens=1024)))
    f8 = kv_shape(
        spec, WorkerConfig(cache=CacheConfig(max_total_tokens=1024, kv_cache_dtype="fp8_e4m3"))
    )
    assert auto.dtype == torch.float32 and auto.kv_scales == ""
    assert f8.dtype == torch.float8_e4m3fn and f8.kv_scales == "1.0"
    assert f8.page_bytes * 4 == auto.page_bytes == 4 * 2 * 2 * 16 * 32 * 4
    assert KVCache(f8).nbytes() * 4 == KVCache(auto).nbytes()


def test_fp8_pages_serve_the_embedded_model_like_float32_pages() -> None:
    """The harness decodes arith prompts with FP8 and float32 pages: the same greedy answers."""
    from tokenizers import Tokenizer

    from orchestrator.tasks import arith

    tok = Tokenizer.from_file(str(EMBEDDED / "tokenizer.json"))
    model, spec = load_model(ModelConfig(path=str(EMBEDDED)), ParallelConfig())
    prompts = [tok.encode(p.prompt).ids for p in arith.make_problems(12, seed=21)]

    def answers(dtype: torch.dtype) -> list[list[int]]:
        h = PagedHarness(model, spec, page_size=16, num_pages=160)
        h.kv = KVCache(KVShape(160, spec.num_layers, spec.num_kv_heads, 16, spec.head_dim, dtype))
        out: list[list[int]] = [[] for _ in prompts]
        logits = h.step([(f"r{i}", ids) for i, ids in enumerate(prompts)])  # all prompts, one step
        for _ in range(arith.ANSWER_MAX_TOKENS):
            nxt = logits.argmax(-1).tolist()
            for i, tok_id in enumerate(nxt):
                out[i].append(tok_id)
            logits = h.step(
                [(f"r{i}", [tok_id]) for i, tok_id in enumerate(nxt)]
            )  # one batched decode
        return [o[: o.index(2) + 1] if 2 in o else o for o in out]  # up to eos (id 2): the answer

    f8, ref = answers(torch.float8_e4m3fn), answers(torch.float32)
    same = sum(a == b for a, b in zip(f8, ref, strict=True))
    assert same >= 11, f"{same}/12 equal"  # measured: 12/12


def test_config_json_quantization_errors_name_the_field() -> None:
    with pytest.raises(
        fp8_config.Fp8Error, match=r"quantization_config.quant_method 'awq' is not supported"
    ):
        fp8_config.parse_quantization_config({"quant_method": "awq"}, "config.json")
    with pytest.raises(fp8_config.Fp8Error, match="weight_block_size must be two positive ints"):
        fp8_config.parse_quantization_config({"quant_method": "fp8"}, "config.json")
    # vLLM's per-tensor FP8 (scalar weight_scale, static input_scale): said to be per-tensor,
    # not 'activation_scheme static is not supported', which sent users after the wrong field
    with pytest.raises(fp8_config.Fp8Error, match=r"weight_block_size .*got None; per-tensor"):
        fp8_config.parse_quantization_config(
            {"quant_method": "fp8", "activation_scheme": "static"}, "config.json"
        )
    with pytest.raises(fp8_config.Fp8Error, match="activation_scheme 'static'"):
        fp8_config.parse_quantization_config(
            {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
            "config.json",
        )
    cfg = fp8_config.parse_quantization_config(
        json.loads(
            '{"quant_method": "fp8", "fmt": "e4m3", '
            '"weight_block_size": [128, 64], "modules_to_not_convert": '
            '["lm_head", "layers.0.mlp"]}'
        ),
        "x",
    )
    assert cfg is not None and (cfg.block_n, cfg.block_k) == (128, 64)
    assert (
        cfg.for_module("model.layers.0.mlp.down_proj") is None
        and cfg.for_module("model.layers.1.mlp") is cfg
    )


def test_fp8_pages_keep_v_token_major_and_never_nan() -> None:
    """A KVCache of e4m3 pages presents V as [P, Hkv, S, D] over a [P, Hkv, D, S] block
    (worker/kv_cache.py): a token's features are a page apart, its neighbours adjacent. K, and
    every page of another dtype, stay feature-major. A NaN reaches a V page as 0 (the Triton
    kernels weight stale slots 0, and 0 times NaN would not be 0)."""
    heads, page, dim = 2, 4, 8
    kv = KVCache(KVShape(6, 3, heads, page, dim, fp8.FP8))
    k_cache, v_cache = kv.layer(1)
    assert v_cache.shape == k_cache.shape == (6, heads, page, dim)
    assert k_cache.stride()[2:] == (dim, 1) and v_cache.stride()[2:] == (1, page)
    assert KVCache(KVShape(6, 3, heads, page, dim, torch.bfloat16)).layer(1)[1].stride(3) == 1
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, heads, dim, generator=g), torch.randn(2, heads, dim, generator=g)
    v[1, 0, 3] = float("nan")
    store_kv(k, v, k_cache, v_cache, torch.tensor([9, 10]), (torch.ones(heads), torch.ones(heads)))
    # page 2, offsets 1 and 2; head 0's block of layer 1's V, as bytes in memory: [D, S]
    block = kv.data[2, 1, 1, 0].reshape(-1).view(fp8.FP8).reshape(dim, page)
    assert torch.equal(block[:, 1].float(), fp8.quantize_kv(v[:1], torch.ones(heads))[0, 0].float())
    assert block[3, 2].item() == 0 and not bool(v_cache.float().isnan().any())


# What llm-compressor writes for a KV-cache-only recipe: the weights stay unquantized (no
# config_groups), `kv_cache_scheme` says FP8, and each layer has self_attn.k_scale / v_scale.
LLM_COMPRESSOR_KV = {
    "quant_method": "compressed-tensors",
    "format": "dense",
    "quantization_status": "compressed",
    "config_groups": {},
    "ignore": ["lm_head"],
    "kv_cache_scheme": {
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True
    },
}


def test_kv_scales_of_an_llm_compressor_kv_cache_checkpoint(tmp_path: Path) -> None:
    """Served with its K/V scales; before, the checkpoint was refused ('quant_method
    'compressed-tensors' is not supported ... serve the unquantized checkpoint', which it is) and
    models/make_fp8.py refused it too. Weight groups or an int8 KV cache are still refused,
    naming the field."""
    path = _with_kv_scales(tmp_path / "ct", torch.tensor([0.02]), torch.tensor([0.01]))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = LLM_COMPRESSOR_KV
    (path / "config.json").write_text(json.dumps(cfg))
    model, spec = load_model(ModelConfig(path=str(path)), ParallelConfig())
    assert spec.kv_scales.startswith("checkpoint per-tensor sha256:")
    attn = model.model.layers[2].self_attn  # type: ignore[union-attr, index]
    assert torch.equal(attn.k_scale, torch.full((2,), 0.02))
    assert torch.equal(attn.v_scale, torch.full((2,), 0.01))

    parse = fp8_config.parse_quantization_config
    weights = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float"}}}
    with pytest.raises(fp8_config.Fp8Error, match=r"quantization_config.config_groups .*weight"):
        parse({**LLM_COMPRESSOR_KV, "config_groups": weights}, "config.json")
    int8 = {**LLM_COMPRESSOR_KV["kv_cache_scheme"], "type": "int"}  # type: ignore[dict-item]
    with pytest.raises(fp8_config.Fp8Error, match=r"quantization_config.kv_cache_scheme .*int"):
        parse({**LLM_COMPRESSOR_KV, "kv_cache_scheme": int8}, "config.json")


def test_kv_scales_no_layer_uses_are_not_claimed(tmp_path: Path) -> None:
    """DeepSeek-V3's MLA latent pages store at scale 1.0 (no K/V split to scale): a checkpoint's
    self_attn.k_scale / v_scale went into the ready line and the contract as 'checkpoint
    per-tensor sha256:…' though no layer used them. Now dropped with a warning: '1.0'."""
    from tests.worker.deepseek_model import build_deepseek_checkpoint

    path = tmp_path / "v3"
    build_deepseek_checkpoint(path, seed=5)
    tensors = load_file(str(path / "model.safetensors"))
    for layer in range(3):
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(0.05)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(0.05)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    assert load_model(ModelConfig(path=str(path)), ParallelConfig())[1].kv_scales == "1.0"


def test_gpt_oss_reads_an_llm_compressor_kv_cache_config(tmp_path: Path) -> None:
    """GPT-OSS refused every quant_method but fp8 as 'MXFP4 expert weights cannot be loaded',
    a KV-cache-only config (unquantized weights) too."""
    from tests.worker.gpt_oss_model import build_gpt_oss_checkpoint
    from worker.arch.load import load_arch_config

    path = tmp_path / "gpt-oss"
    build_gpt_oss_checkpoint(path, seed=1)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = LLM_COMPRESSOR_KV
    (path / "config.json").write_text(json.dumps(cfg))
    assert load_arch_config(path).quant is None
