"""Our paged model against transformers: logits, greedy generations, loading paths, errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from worker.arch.hf_config import parse_arch_config, parse_rope
from worker.config import ModelConfig, ParallelConfig
from worker.model import ModelLoadError, load_model
from worker.sampler import Sampler
from worker.sampling import SamplingParams

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 10000.0,
}
YARN_ROPE = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "rope_theta": 10000.0,
}

# (family, overrides): GQA everywhere; tied and untied; biases; the RoPE variants; a window.
CASES = {
    "qwen3-untied": ("qwen3", {}),
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    "qwen2-bias-yarn": ("qwen2", {"rope_parameters": YARN_ROPE}),
    "llama-llama3-bias": (
        "llama",
        {"rope_parameters": LLAMA3_ROPE, "attention_bias": True, "mlp_bias": True},
    ),
    "llama-linear-tied": (
        "llama",
        {
            "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
            "tie_word_embeddings": True,
        },
    ),
    "mistral-window": ("mistral", {"sliding_window": 8}),
    "llama-dynamic": (
        "llama",
        {
            "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
            "max_position_embeddings": 24,
        },
    ),
}


def load(path: Path, **kw: object):  # noqa: ANN201 - (CausalLM, ModelSpec)
    return load_model(ModelConfig(path=str(path), **kw), ParallelConfig())  # type: ignore[arg-type]


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_prefill_and_decode_logits_match_transformers(
    case, tiny_checkpoint, paged_harness
) -> None:
    family, overrides = CASES[case]
    path, hf = tiny_checkpoint(family, **overrides)
    model, spec = load(path)
    harness = paged_harness(model, spec, page_size=4)
    rng = random.Random(1)
    seqs = {
        "a": [rng.randrange(97) for _ in range(30)],
        "b": [rng.randrange(97) for _ in range(21)],
    }
    with torch.no_grad():
        ref = {r: hf(torch.tensor([s])).logits[0] for r, s in seqs.items()}  # [L, V]
    # Dynamic NTK depends on the length at each step, so prefill it in one chunk (see rope.py).
    chunks = (
        {"a": [0, 30], "b": [0, 21]}
        if case == "llama-dynamic"
        else {"a": [0, 7, 16, 22], "b": [0, 9, 13]}
    )
    # Prefill both in interleaved chunks, then decode token by token in a shared batch.
    steps = max(len(c) for c in chunks.values()) - 1
    pos = {r: 0 for r in seqs}
    worst = 0.0
    for step in range(steps + 10):
        batch = []
        for r, bounds in chunks.items():
            end = bounds[step + 1] if step + 1 < len(bounds) else pos[r] + 1
            if end <= len(seqs[r]) and end > pos[r]:
                batch.append((r, seqs[r][pos[r] : end]))
        if not batch:
            break
        logits = harness.step(batch)
        for (r, toks), row in zip(batch, logits, strict=True):
            pos[r] += len(toks)
            worst = max(worst, float((row - ref[r][pos[r] - 1]).abs().max()))
    assert pos == {r: len(s) for r, s in seqs.items()}  # every token went through the paged path
    assert worst < 1e-4, f"{case}: max |logit diff| {worst}"


@pytest.mark.parametrize(
    "case", ["qwen3-untied", "qwen2-bias-yarn", "llama-llama3-bias", "llama-dynamic"]
)
def test_greedy_generation_matches_transformers_generate(
    case, tiny_checkpoint, paged_harness
) -> None:
    family, overrides = CASES[case]
    path, hf = tiny_checkpoint(family, **overrides)
    model, spec = load(path)
    prompt = [random.Random(2).randrange(97) for _ in range(13)]
    with torch.no_grad():
        hf_out = hf.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=20,
            min_new_tokens=20,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    harness = paged_harness(model, spec, page_size=4)
    sampler, params = Sampler(), SamplingParams(temperature=0.0, max_tokens=20)
    ours: list[int] = []
    logits = harness.step([("r", prompt[:5])]) if case != "llama-dynamic" else None
    logits = (
        harness.step([("r", prompt[5:])]) if logits is not None else harness.step([("r", prompt)])
    )
    while len(ours) < 20:
        # min_tokens mirrors HF's min_new_tokens (which bans eos until 20 tokens are out).
        p = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=20)
        out = sampler.sample(logits, [p], [None], [ours], [len(ours)], spec.eos_token_ids)
        ours.append(out.token_ids[0])
        logits = harness.step([("r", [ours[-1]])])
    assert params.greedy
    assert ours == hf_out


def test_sharded_checkpoint_loads_and_matches(tiny_checkpoint, paged_harness) -> None:
    path, hf = tiny_checkpoint("qwen3", max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").exists()
    assert len(list(path.glob("*.safetensors"))) > 2
    model, spec = load(path)
    ids = list(range(5, 25))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    got = paged_harness(model, spec).step([("r", ids)])[0]
    assert float((got - ref).abs().max()) < 1e-4


def test_spec_fingerprint_and_eos(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("llama", eos_token_id=[2, 5])
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    _, spec = load(path)
    assert spec.architecture == "LlamaForCausalLM"
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (2, 4, 2, 16)
    assert spec.eos_token_ids == (7, 2, 5)
    assert spec.dtype == torch.float32 and spec.sliding_window is None
    assert load(path)[1].fingerprint == spec.fingerprint  # stable
    other, _ = tiny_checkpoint("llama", eos_token_id=[2, 5], seed=1)  # same config, other weights
    assert load(other)[1].fingerprint != spec.fingerprint


def test_dummy_load_uses_real_shapes_without_weight_files(tmp_path: Path) -> None:
    cfg = {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 96,
        "intermediate_size": 160,
        "num_hidden_layers": 3,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 211,
        "max_position_embeddings": 512,
        "torch_dtype": "bfloat16",
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "eos_token_id": 3,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model, spec = load(tmp_path, load_format="dummy", seed=7)
    assert (
        spec.fingerprint == "dummy:7"
        and spec.dtype == torch.bfloat16
        and spec.eos_token_ids == (3,)
    )
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj.weight.shape == ((6 + 2 + 2) * 32, 96)
    assert model.model.layers[2].mlp.gate_up_proj.weight.shape == (2 * 160, 96)
    assert model.lm_head is not None and model.lm_head.weight.shape == (211, 96)
    assert torch.all(model.model.norm.weight == 1) and torch.all(attn.q_norm.weight == 1)
    assert not any(p.is_meta for p in model.parameters())
    again, _ = load(tmp_path, load_format="dummy", seed=7)
    assert torch.equal(again.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert not torch.equal(
        load(tmp_path, load_format="dummy", seed=8)[0].model.embed_tokens.weight,
        model.model.embed_tokens.weight,
    )


def test_dtype_auto_float16_becomes_float32_on_cpu(tmp_path: Path) -> None:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "vocab_size": 50,
        "torch_dtype": "float16",
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load(tmp_path, load_format="dummy")[1].dtype == torch.float32
    assert load(tmp_path, load_format="dummy", dtype="bfloat16")[1].dtype == torch.bfloat16


def test_clear_errors(tiny_checkpoint, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not a directory"):
        load(tmp_path / "absent")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="Qwen3ForCausalLM"):  # names the supported ones
        load(tmp_path)
    path, _ = tiny_checkpoint("qwen3")
    with pytest.raises(ModelLoadError, match="torch.distributed initialized"):
        load_model(ModelConfig(path=str(path)), ParallelConfig(tp_size=2, tp_rank=0))
    (path / "model.safetensors").rename(path / "moved.bin")
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        load(path)
    path, _ = tiny_checkpoint("qwen3")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight"):
        load(path)


def test_rope_both_spellings_parse_the_same() -> None:
    new = parse_rope(
        {
            "max_position_embeddings": 64,
            "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
        },
        "c",
    )
    old = parse_rope(
        {
            "max_position_embeddings": 64,
            "rope_theta": 500.0,
            "rope_scaling": {"type": "linear", "factor": 2.0},
        },
        "c",
    )
    assert new == old and new.theta == 500.0 and new.factor == 2.0
    with pytest.raises(ModelLoadError, match="longrope"):
        parse_rope({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "c")


def test_qwen2_window_only_when_enabled() -> None:
    base = {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "vocab_size": 50,
        "sliding_window": 16,
        "max_window_layers": 2,
    }
    assert parse_arch_config(base).sliding_window is None
    on = parse_arch_config({**base, "use_sliding_window": True})
    assert on.layer_windows == (None, None, 16, 16) and on.sliding_window == 16


EMBEDDED = Path(__file__).resolve().parents[2] / "models" / "tandem-arith"


@pytest.mark.skipif(
    not (EMBEDDED / "config.json").exists(), reason="models/tandem-arith not trained yet"
)
def test_embedded_model_matches_transformers(paged_harness) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(EMBEDDED, dtype=torch.float32).eval()
    model, spec = load(EMBEDDED, dtype="float32")
    ids = [random.Random(3).randrange(min(spec.vocab_size, 50)) for _ in range(40)]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    harness = paged_harness(model, spec, page_size=16, num_pages=16)
    harness.step([("r", ids[:17])])
    got = harness.step([("r", ids[17:])])[0]
    assert float((got - ref).abs().max()) < 1e-3


def _tp_rank_main(rank: int, path: str, init_file: str, out_dir: str, ids: list[int]) -> None:
    """One TP rank: load its shard, prefill in two chunks, decode three tokens, save logits."""
    import torch.distributed as dist

    from tests.worker.conftest import PagedHarness

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        model, spec = load_model(ModelConfig(path=path), ParallelConfig(tp_size=2, tp_rank=rank))
        harness = PagedHarness(model, spec, tp_size=2)
        rows = [harness.step([("r", ids[:9])]), harness.step([("r", ids[9:-3])])]
        rows += [harness.step([("r", [t])]) for t in ids[-3:]]
        torch.save(torch.cat(rows), f"{out_dir}/logits{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_2_ranks_match_transformers(tiny_checkpoint, tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    path, hf = tiny_checkpoint(
        "qwen2", num_key_value_heads=2
    )  # q/k/v biases: sharded with the heads
    ids = [random.Random(4).randrange(97) for _ in range(20)]
    mp.spawn(_tp_rank_main, args=(str(path), str(tmp_path / "init"), str(tmp_path), ids), nprocs=2)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]  # [L, V]
    want = ref[[8, 16, 17, 18, 19]]
    for rank in (0, 1):
        got = torch.load(tmp_path / f"logits{rank}.pt")
        assert float((got - want).abs().max()) < 1e-4
