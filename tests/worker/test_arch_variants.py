"""Checkpoint variants a newcomer brings, written by transformers and served by our engine.

Each case saves a tiny random model with one config field set the way some real checkpoint
sets it (RoPE spellings and types, head_dim, MQA/MHA, tied embeddings, odd vocab and
intermediate sizes, window rules, MoE layouts, a bfloat16 file), then runs prompts through the
`Engine` and asserts the greedy tokens and every step's logits equal transformers' (float32,
|diff| < 1e-4). Regressions found by that sweep are pinned here too:

- an odd `moe_intermediate_size` made torch's grouped GEMM raise on the CPU (16-byte strides);
- a `sliding_window` in a Llama / Qwen3-Next config.json was applied, though transformers'
  models of those families attend to every token (a silent mismatch past the window);
- `mlp_bias` outside Llama and `attention_bias` on Mistral, which transformers does not read,
  asked the checkpoint for bias tensors it does not have (the load failed);
- per-layer-type `rope_parameters` were read as one flat dict (theta silently 10000);
- weights wider than config.json implies (its head_dim, intermediate_size or vocab_size smaller
  than the tensors') loaded silently truncated, as each rank reads only its slice;
- a top-level `original_max_position_embeddings` beside a yarn / llama3 `rope_parameters` one:
  transformers takes the top-level value, ours took the nested one (wrong logits);
- `tie_word_embeddings` beside a different `lm_head.weight`: served the embedding silently
  (transformers 5 keeps the separate head); now refused.

What we do not run is refused at load with one line naming the field.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.worker.test_engine import generate
from worker.arch.hf_config import ModelLoadError, parse_arch_config
from worker.arch.qwen3_next_config import parse_qwen3_next_config
from worker.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.model.moe import ExpertGroups, grouped_linear
from worker.model.weights import WeightShapeError

TINY: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=97, max_position_embeddings=128, rms_norm_eps=1e-6,
    initializer_range=0.2, eos_token_id=2, pad_token_id=0,
)
MOE: dict[str, Any] = dict(head_dim=16, num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=32, initializer_range=0.1)
CONFIGS = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
           "qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig"}


def build(path: Path, family: str, overrides: dict[str, Any],
          dtype: torch.dtype = torch.float32, edit: dict[str, Any] | None = None) -> Path:
    """Save a seeded tiny `family` model at `path` (norms and biases drawn away from their init,
    so a dropped one changes the logits); `edit` then rewrites config.json fields by hand."""
    import json

    import transformers

    base = {**TINY, **(MOE if family == "qwen3_moe" else {}),
            **({"head_dim": 16} if family == "qwen3" else {})}
    config = getattr(transformers, CONFIGS[family])(**{**base, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5, generator=gen)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.3, generator=gen)
    model.to(dtype).save_pretrained(path)
    if edit:
        cfg = json.loads((path / "config.json").read_text())
        cfg.update(edit)
        (path / "config.json").write_text(json.dumps(cfg))
    return path


def engine_vs_transformers(path: Path, lens: tuple[int, ...] = (5, 23, 41), new: int = 10,
                           chunk: int = 256) -> tuple[list[list[int]], list[list[int]], float]:
    """(our greedy tokens, transformers', the largest |logit diff| over every step) for prompts
    of `lens` tokens, one request at a time, both sides in float32 from the saved checkpoint."""
    import transformers

    engine = Engine(WorkerConfig(
        model=ModelConfig(path=str(path), dtype="float32"),
        cache=CacheConfig(page_size=4, num_pages=128),
        scheduler=SchedulerConfig(max_num_seqs=4, chunked_prefill_size=chunk), num_threads=1))
    # eager experts: transformers' grouped GEMM raises at widths that are not 16-byte multiples
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, experts_implementation="eager").eval()
    hf.generation_config.eos_token_id = None  # plain greedy, as ours with ignore_eos
    model, steps = engine.model, []
    compute_logits = model.compute_logits

    def recorded(hidden: torch.Tensor) -> torch.Tensor:
        steps.append(compute_logits(hidden).float())
        return steps[-1]

    model.compute_logits = recorded  # type: ignore[method-assign]
    rng = random.Random(3)
    ours, theirs, worst = [], [], 0.0
    for n in lens:
        prompt = [rng.randrange(3, engine.spec.vocab_size) for _ in range(n)]
        steps.clear()
        ours += generate(engine, [prompt], max_tokens=new)
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new,
                              output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        theirs.append(out.sequences[0, n:].tolist())
        for a, b in zip(steps, out.logits, strict=True):
            worst = max(worst, float((a[0] - b[0].float()).abs().max()))
    engine.scheduler.assert_drained()
    return ours, theirs, worst


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
        "rope_theta": 1e6}
WINDOW = {"use_sliding_window": True, "sliding_window": 8}
# (family, transformers config overrides, config.json edits, checkpoint dtype)
VARIANTS: dict[str, tuple[str, dict[str, Any], dict[str, Any] | None, torch.dtype]] = {
    # the pre-transformers-5 spelling: top-level rope_theta, rope_scaling beside it
    "llama-llama3-rope-scaling": ("llama", {}, {"rope_parameters": None, "rope_theta": 5e5,
                                                "rope_scaling": LLAMA3}, torch.float32),
    "llama-yarn-attention-factor": (
        "llama", {"rope_parameters": {**YARN, "attention_factor": 0.8, "beta_fast": 16}}, None,
        torch.float32),
    "llama-head-dim-32-mqa-biases": ("llama", {"head_dim": 32, "num_key_value_heads": 1,
                                               "attention_bias": True, "mlp_bias": True},
                                     None, torch.float32),
    "llama-odd-vocab-and-intermediate-tied": (
        "llama", {"vocab_size": 1001, "intermediate_size": 97, "tie_word_embeddings": True},
        None, torch.float32),
    "mistral-window-mha-bf16-file": ("mistral", {"sliding_window": 8, "num_key_value_heads": 4},
                                     None, torch.bfloat16),
    "qwen2-max-window-layers-tied": ("qwen2", {**WINDOW, "max_window_layers": 1,
                                               "tie_word_embeddings": True}, None, torch.float32),
    "qwen3-layer-types-yarn": ("qwen3", {**WINDOW, "rope_parameters": YARN, "layer_types": [
        "sliding_attention", "full_attention"]}, None, torch.float32),
    "qwen3-moe-sparse-step-mlp-only-norm-topk": (
        "qwen3_moe", {"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [1],
                      "norm_topk_prob": True, "attention_bias": True}, None, torch.float32),
    # regression: torch._grouped_mm needs 16-byte strides (33 float32 columns are 132 bytes)
    "qwen3-moe-odd-moe-intermediate": ("qwen3_moe", {"moe_intermediate_size": 33}, None,
                                       torch.float32),
    # regression: fields their transformers models do not read asked for absent bias tensors
    "qwen3-mlp-bias-field-unread": ("qwen3", {}, {"mlp_bias": True}, torch.float32),
    "mistral-attention-bias-field-unread": ("mistral", {}, {"attention_bias": True},
                                            torch.float32),
    # regression: a top-level original_max_position_embeddings (Phi-3 style) outranks the one in
    # rope_parameters for yarn / llama3 in transformers; ours read the nested one
    "llama-yarn-top-level-original": (
        "llama", {"rope_parameters": {**YARN, "rope_theta": 1e4}},
        {"original_max_position_embeddings": 16}, torch.float32),
    "qwen2-llama3-top-level-original": (
        "qwen2", {"rope_parameters": {**LLAMA3, "original_max_position_embeddings": 32}},
        {"original_max_position_embeddings": 8}, torch.float32),
}


@pytest.mark.parametrize("case", list(VARIANTS))
def test_variant_matches_transformers(case: str, tmp_path: Path) -> None:
    family, overrides, edit, dtype = VARIANTS[case]
    path = build(tmp_path, family, overrides, dtype, edit)
    ours, theirs, worst = engine_vs_transformers(path)
    assert worst < 1e-4, f"{case}: max |logit diff| {worst}"
    assert ours == theirs


def test_grouped_linear_at_widths_the_grouped_gemm_refuses() -> None:
    """Rows 33 float32 wide (132 bytes) take the per-expert loop, with the same result."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 33, generator=gen)  # [N, in]
    weight = torch.randn(3, 17, 33, generator=gen)  # [E, out, in]
    bias = torch.randn(3, 17, generator=gen)
    ids = torch.tensor([2, 0, 2, 1, 0, 2, 2])
    groups = ExpertGroups.of(ids, 3)
    got = groups.unsort(grouped_linear(groups.sort(x), weight, groups, bias))
    want = torch.einsum("ni,noi->no", x, weight[ids]) + bias[ids]
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    ("arch", "windows"),
    [("LlamaForCausalLM", (None, None)), ("Qwen3NextForCausalLM", (None, None)),
     ("MistralForCausalLM", (8, 8)), ("Qwen3MoeForCausalLM", (8, 8))],
)
def test_sliding_window_is_read_only_where_transformers_reads_it(
    arch: str, windows: tuple[int | None, ...]
) -> None:
    cfg = {**TINY, "architectures": [arch], "sliding_window": 8, "use_sliding_window": True,
           "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "shared_expert_intermediate_size": 32}
    parse = parse_qwen3_next_config if arch == "Qwen3NextForCausalLM" else parse_arch_config
    assert parse(cfg).layer_windows == windows


def test_llama_with_a_sliding_window_field_attends_to_every_token(tmp_path: Path) -> None:
    """Left in a Llama config.json (e.g. by a Mistral conversion), sliding_window is unused by
    transformers' LlamaForCausalLM. (Its `generate` still sizes a sliding KV cache from it and
    drifts while decoding, so the reference is its forward over the whole sequence.)"""
    import transformers

    path = build(tmp_path, "llama", {}, edit={"sliding_window": 8})
    engine = Engine(WorkerConfig(model=ModelConfig(path=str(path), dtype="float32"),
                                 cache=CacheConfig(page_size=4, num_pages=64), num_threads=1))
    assert engine.spec.layer_windows == (None, None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = [random.Random(4).randrange(3, 97) for _ in range(23)]
    ours = generate(engine, [prompt], max_tokens=8)[0]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1 : -1]  # [8, V]
    assert logits.argmax(-1).tolist() == ours


@pytest.mark.parametrize(("family", "overrides", "edit"), [
    ("mistral", {"head_dim": 20}, {"head_dim": None}),  # config says 64 / 4 heads = 16
    ("llama", {}, {"intermediate_size": 64}),
    ("llama", {}, {"vocab_size": 90}),
], ids=["head_dim", "intermediate_size", "vocab_size"])
def test_weights_wider_than_config_json_are_refused(
        tmp_path: Path, family: str, overrides: dict[str, Any], edit: dict[str, Any]) -> None:
    """transformers refuses such a load; ours read each rank's slice of the wider tensor, which
    fit, and served truncated weights (wrong tokens) at TP=1."""
    path = build(tmp_path, family, overrides, edit=edit)
    with pytest.raises(WeightShapeError, match="does config.json match the weights"):
        Engine(WorkerConfig(model=ModelConfig(path=str(path), dtype="float32"),
                            cache=CacheConfig(page_size=4, num_pages=64), num_threads=1))


LLAMA_CFG: dict[str, Any] = {**TINY, "architectures": ["LlamaForCausalLM"]}
REFUSED = {
    "partial_rotary_factor": {"partial_rotary_factor": 0.5},
    "rope type 'longrope'": {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
    "rope type 'su'": {"rope_scaling": {"type": "su", "short_factor": [1.0]}},
    "needs a 'factor'": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}},
    # transformers refuses it too; ours took Llama 3.1's 1.0 / 4.0 silently
    "needs 'low_freq_factor' and 'high_freq_factor'": {"rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}},
    "rope_parameters per layer type (full_attention, sliding_attention)": {"rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
    "hidden_act 'gelu'": {"hidden_act": "gelu"},
    "quant_method 'gptq'": {"quantization_config": {"quant_method": "gptq", "bits": 4}},
    # transformers' FineGrainedFP8Config: FP4-packed experts (int8, K halved, per-32 scales)
    "expert_dtype 'fp4'": {"quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128, 128], "expert_dtype": "fp4"}},
}


@pytest.mark.parametrize("field", list(REFUSED))
def test_what_we_do_not_run_is_refused_in_one_line_naming_the_field(field: str) -> None:
    with pytest.raises(ModelLoadError) as exc:
        parse_arch_config({**LLAMA_CFG, **REFUSED[field]}, source="ckpt/config.json")
    message = str(exc.value)
    assert message.startswith("ckpt/config.json: ") and field in message and "\n" not in message


def test_tied_config_with_a_different_lm_head_in_the_checkpoint_is_refused(
        tmp_path: Path) -> None:
    """tie_word_embeddings true beside an lm_head.weight that is not the embedding: transformers
    4 ties (the embedding wins), transformers 5 keeps the separate head; ours served the
    embedding silently. Refused now in one line naming the field; an equal copy still loads."""
    from safetensors.torch import load_file, save_file

    path = build(tmp_path, "llama", {"tie_word_embeddings": True})
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    ours, theirs, _ = engine_vs_transformers(path, lens=(5,), new=2)  # a copy: both tie
    assert ours == theirs
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 0.01
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="tie_word_embeddings") as exc:
        Engine(WorkerConfig(model=ModelConfig(path=str(path), dtype="float32"),
                            cache=CacheConfig(page_size=4, num_pages=64), num_threads=1))
    assert "\n" not in str(exc.value)
