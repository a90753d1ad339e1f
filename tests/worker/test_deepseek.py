"""DeepSeek-V3 (MLA latent pages, DeepSeek MoE, MTP) against transformers, on CPU.

- logits of chunked prefills and batched decodes over paged latents equal transformers' for
  the full-featured config (q_lora, YaRN + mscale, interleaved rope, grouped routing with a
  correction bias, shared experts), the no-q_lora form with plain rope, and an all-dense tied one;
- the engine's greedy tokens equal transformers' `generate` with prompts longer than a chunk and
  prefix-cache hits (same prompt twice, a shared long prefix), every page back afterwards;
- MTP layers load when the checkpoint has them and are dropped when it does not;
- config errors name the field; the latent KV cache's shape, bytes and cache group.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from tests.worker.conftest import PagedHarness
from tests.worker.deepseek_model import CONFIG, LATENT_DIM, build_deepseek_checkpoint
from transfer.contract import CacheGroup, CacheKind
from worker.arch.deepseek_config import parse_deepseek_v3
from worker.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.kv_cache import KVCache, KVShape, cache_groups
from worker.model import ModelLoadError, load_model
from worker.model.base import CausalLM, ModelSpec

PLAIN_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
CASES = {
    "v3-qlora-yarn-interleave": {},
    "no-qlora-rotate-half-one-group": {
        "q_lora_rank": None,
        "rope_interleave": False,
        "rope_parameters": PLAIN_ROPE,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": False,
        "attention_bias": True,  # kv_a_proj_with_mqa and o_proj biases (q_proj has none)
    },
    "all-dense-tied": {"first_k_dense_replace": 3, "tie_word_embeddings": True},
    # DeepseekV3Config's default num_key_value_heads (128) is written even for 4 heads: MLA
    # has no kv heads, so the parser must not apply the K/V models' heads % kv_heads rule.
    "kv-heads-left-at-128": {"num_key_value_heads": 128, "attention_bias": True},  # + q_a_proj bias
}


def latent_harness(model: CausalLM, spec: ModelSpec, page_size: int = 4) -> PagedHarness:
    """The shared paged harness over MLA latent pages instead of K/V pages."""
    harness = PagedHarness(model, spec, page_size=page_size)
    harness.kv = KVCache(
        KVShape(
            64,
            spec.num_layers,
            1,
            page_size,
            spec.head_dim,
            spec.dtype,
            latent_dim=spec.kv_latent_dim,
        )
    )
    return harness


@pytest.fixture(scope="module")
def v3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("deepseek-v3")
    return path, build_deepseek_checkpoint(path, mtp=True)


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_prefill_and_decode_logits_match_transformers(case: str, tmp_path: Path) -> None:
    hf = build_deepseek_checkpoint(tmp_path, tokenizer=False, **CASES[case])
    model, spec = load_model(ModelConfig(path=str(tmp_path)), ParallelConfig())
    assert (spec.num_kv_heads, spec.head_dim, spec.kv_latent_dim) == (1, LATENT_DIM, LATENT_DIM)
    harness = latent_harness(model, spec)
    rng = random.Random(1)
    seqs = {
        "a": [rng.randrange(128) for _ in range(30)],
        "b": [rng.randrange(128) for _ in range(21)],
    }
    with torch.no_grad():
        ref = {r: hf(torch.tensor([s])).logits[0] for r, s in seqs.items()}  # [L, V]
    bounds = {"a": [0, 7, 16, 22], "b": [0, 9, 13]}  # interleaved chunks, then shared decode steps
    pos = {r: 0 for r in seqs}
    worst = 0.0
    for step in range(20):
        batch = []
        for r, b in bounds.items():
            end = b[step + 1] if step + 1 < len(b) else pos[r] + 1
            if pos[r] < end <= len(seqs[r]):
                batch.append((r, seqs[r][pos[r] : end]))
        if not batch:
            break
        for (r, toks), row in zip(batch, harness.step(batch), strict=True):
            pos[r] += len(toks)
            worst = max(worst, float((row - ref[r][pos[r] - 1]).abs().max()))
    assert pos == {r: len(s) for r, s in seqs.items()}
    assert worst < 1e-4, f"{case}: max |logit diff| {worst}"


def _engine(path: Path, num_pages: int = 96) -> Engine:
    return Engine(
        WorkerConfig(
            model=ModelConfig(path=str(path), dtype="float32"),
            cache=CacheConfig(page_size=4, num_pages=num_pages),
            scheduler=SchedulerConfig(
                max_num_seqs=4, chunked_prefill_size=16
            ),  # prompts span chunks
            num_threads=1,
        )
    )


def test_engine_greedy_equals_transformers_generate_with_prefix_hits(
    v3: tuple[Path, torch.nn.Module],
) -> None:
    from tests.worker.test_engine import generate

    path, hf = v3
    rng = random.Random(3)
    shared = [rng.randrange(3, 128) for _ in range(24)]
    prompts = [[rng.randrange(3, 128) for _ in range(37)], shared + [5, 9, 11], shared + [7, 13]]
    prompts.append(list(prompts[0]))  # the same prompt again: a full prefix hit
    engine = _engine(path)
    # The first two alone, so that the shared prefix and the repeat find their pages cached.
    got = generate(engine, prompts[:1], max_tokens=8) + generate(engine, prompts[1:2], max_tokens=8)
    got += generate(engine, prompts[2:], max_tokens=8)
    for prompt, tokens in zip(prompts, got, strict=True):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8
            )
        assert tokens == out[0, len(prompt) :].tolist()
    # Prefix hits skipped whole pages of 4: the repeat's 9 full pages, the shared prefix's 6.
    total = sum(len(p) for p in prompts)
    assert engine.scheduler.prompt_tokens_computed <= total - (36 + 24)
    engine.scheduler.assert_drained()


def test_preemption_recomputes_latent_pages_exactly(v3: tuple[Path, torch.nn.Module]) -> None:
    """Out of latent pages, the newest request is preempted and recomputed: same tokens, no leak."""
    from tests.worker.test_engine import generate

    path, _ = v3
    rng = random.Random(8)
    prompts = [[rng.randrange(3, 128) for _ in range(14)] for _ in range(4)]
    roomy = generate(_engine(path), prompts, max_tokens=18)
    tight = _engine(path, num_pages=20)  # 4 x 32 tokens need 32 pages of 4
    assert generate(tight, prompts, max_tokens=18) == roomy
    assert tight.scheduler.num_preemptions > 0
    tight.scheduler.assert_drained()


def test_mtp_layer_loads_when_present_and_is_dropped_when_absent(
    v3: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    from safetensors import safe_open

    path, _ = v3
    model, _ = load_model(ModelConfig(path=str(path)), ParallelConfig())
    assert len(model.mtp) == 1  # type: ignore[arg-type]
    n = CONFIG["num_hidden_layers"]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        want = f.get_tensor(f"model.layers.{n}.eh_proj.weight")
        want_expert = f.get_tensor(f"model.layers.{n}.mlp.experts.3.up_proj.weight")
    mtp = model.mtp[0]  # type: ignore[index]
    assert torch.equal(mtp.eh_proj.weight, want)
    assert torch.equal(mtp.block.mlp.w13[3, CONFIG["moe_intermediate_size"] :], want_expert)
    build_deepseek_checkpoint(tmp_path, tokenizer=False)  # config.json says 1 MTP layer, no tensors
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    model, _ = load_model(ModelConfig(path=str(tmp_path)), ParallelConfig())
    assert len(model.mtp) == 0  # type: ignore[arg-type]
    assert not any(".layers.3." in name for name in model.weight_slots())


def test_dummy_weights_at_real_shapes_run(tmp_path: Path) -> None:
    build_deepseek_checkpoint(tmp_path, tokenizer=False)
    model, spec = load_model(ModelConfig(path=str(tmp_path), load_format="dummy"), ParallelConfig())
    harness = latent_harness(model, spec)
    logits = harness.step([("a", list(range(10)))])
    assert logits.shape == (1, 128) and bool(torch.isfinite(logits).all())


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"n_group": 3}, "n_group"),
        ({"topk_group": 5}, "topk_group"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
        ({"kv_lora_rank": 0}, "kv_lora_rank"),
        ({"q_lora_rank": 0}, "q_lora_rank"),
        ({"moe_layer_freq": 2}, "moe_layer_freq"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config.quant_method"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config.weight_block"),
    ],
)
def test_config_errors_name_the_field(change: dict[str, object], field: str) -> None:
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], **CONFIG, **change}
    with pytest.raises(ModelLoadError, match=field):
        parse_deepseek_v3(cfg, None, "config.json")


def test_parsed_config_carries_mla_routing_and_softmax_scale() -> None:
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], **CONFIG, "num_nextn_predict_layers": 1}
    arch = parse_deepseek_v3(cfg, None, "config.json")
    assert arch.family is not None and arch.moe is not None
    mla = arch.family.mla
    assert (mla.kv_lora_rank, mla.qk_rope_head_dim, mla.latent_dim, arch.kv_latent_dim) == (
        32,
        8,
        40,
        40,
    )
    assert arch.moe.sparse_layers == (False, True, True)  # first_k_dense_replace=1
    assert (arch.family.n_group, arch.family.topk_group, arch.family.num_mtp_layers) == (
        4,
        2,
        1,
    )
    # transformers' scaling: qk_head_dim^-0.5 * (0.1 * mscale_all_dim * ln(factor) + 1)^2
    want = 24**-0.5 * (0.1 * 1.0 * torch.log(torch.tensor(4.0)).item() + 1) ** 2
    assert mla.softmax_scale == pytest.approx(want)


def test_latent_kv_cache_shape_bytes_and_group() -> None:
    shape = KVShape(
        num_pages=8,
        num_layers=3,
        num_kv_heads=1,
        page_size=4,
        head_dim=40,
        dtype=torch.float32,
        latent_dim=40,
    )
    kv = KVCache(shape)
    assert kv.latent(2).shape == (8, 4, 40)
    assert shape.page_bytes == 3 * 4 * 40 * 4  # no heads, no K/V pair: layers * tokens * latent
    assert kv.nbytes() == 8 * shape.page_bytes
    kv.latent(1)[5, 2] = 7.0  # page-major: page 5 holds every layer's rows for its 4 tokens
    assert kv.data[5].flatten().nonzero().numel() == 40
    assert cache_groups(shape) == (CacheGroup(CacheKind.MLA_LATENT, (0, 1, 2), latent_dim=40),)
    with pytest.raises(TypeError, match="latent"):
        kv.layer(0)
    with pytest.raises(ValueError, match="latent"):
        KVShape(8, 3, 2, 4, 40, torch.float32, latent_dim=40)  # an MLA cache has one "head"
