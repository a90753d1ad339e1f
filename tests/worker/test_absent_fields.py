"""A config.json that leaves a field out means what transformers' config class means by it.

transformers fills an absent field with its config class's default, and those differ by family
(Mistral slides a 4096-token window, GPT-OSS a 128-token one on every other layer, Qwen3's
head_dim is 128, DeepSeek-V3 scales its routed experts by 2.5, ...). Ours read each absent field
as "off" or "derived" (no window, hidden / heads, 1.0): a hand-written or trimmed config.json
whose weights still fit was served differently from transformers, silently. Each case drops
one field from a tiny family config and asserts that our reading of the trimmed dict equals our
reading of what transformers makes of it, or that both refuse it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from orchestrator.checkpoint import read_config_json
from worker.arch.hf_config import ArchConfig, ModelLoadError
from worker.arch.load import load_arch_config

SMALL: dict[str, Any] = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, vocab_size=97)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {"num_key_value_heads": 2}),
    "mistral": ("MistralConfig", {"num_key_value_heads": 2, "sliding_window": 8}),
    "qwen2": ("Qwen2Config", {"num_key_value_heads": 2, "use_sliding_window": True,
                              "sliding_window": 8}),
    "qwen3": ("Qwen3Config", {"num_key_value_heads": 2, "head_dim": 16,
                              "use_sliding_window": True, "sliding_window": 8}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_key_value_heads": 2, "head_dim": 16,
                                     "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32}),
    "gpt_oss": ("GptOssConfig", {"num_key_value_heads": 2, "head_dim": 16,
                                 "num_local_experts": 4, "num_experts_per_tok": 2,
                                 "sliding_window": 8}),
    "qwen3_next": ("Qwen3NextConfig", {"num_key_value_heads": 2, "head_dim": 32,
                                       "num_experts": 4, "num_experts_per_tok": 2,
                                       "moe_intermediate_size": 32,
                                       "shared_expert_intermediate_size": 48,
                                       "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                                       "linear_key_head_dim": 16, "linear_value_head_dim": 8}),
    "deepseek_v3": ("DeepseekV3Config", {"num_key_value_heads": 4, "kv_lora_rank": 32,
                                         "q_lora_rank": 48, "qk_rope_head_dim": 8,
                                         "qk_nope_head_dim": 16, "v_head_dim": 16,
                                         "moe_intermediate_size": 32, "n_routed_experts": 8,
                                         "n_group": 4, "topk_group": 2, "num_experts_per_tok": 2,
                                         "n_shared_experts": 2, "first_k_dense_replace": 1,
                                         "routed_scaling_factor": 2.0,
                                         "num_nextn_predict_layers": 0}),
}
# Written by save_pretrained whatever the model; not what this file is about.
_NOT_DROPPED = {"architectures", "model_type", "transformers_version", "dtype", "layer_types"}


def _full_config(family: str) -> dict[str, Any]:
    import transformers

    name, fields = FAMILIES[family]
    config = getattr(transformers, name)(**{**SMALL, **fields}, max_position_embeddings=64,
                                         eos_token_id=5)
    config.architectures = [name.replace("Config", "ForCausalLM")]
    return json.loads(config.to_json_string(use_diff=False))


def _read(tmp_path: Path, cfg: dict[str, Any]) -> ArchConfig | str:
    """Our reading of `cfg` as a checkpoint's config.json, or 'refused'."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    try:
        return load_arch_config(tmp_path)
    except ModelLoadError:
        return "refused"


def _cases() -> list[tuple[str, str]]:
    import transformers

    out = []
    for family, (name, _) in FAMILIES.items():
        written = getattr(transformers, name)(**SMALL).to_dict()
        out += [(family, key) for key in sorted(written) if key not in _NOT_DROPPED]
    return out


@pytest.mark.parametrize(("family", "field"), _cases())
def test_an_absent_field_means_what_transformers_means(
        family: str, field: str, tmp_path: Path) -> None:
    import transformers
    from huggingface_hub.errors import StrictDataclassClassValidationError

    full = _full_config(family)
    if field not in full:
        pytest.skip(f"{family} writes no {field}")
    trimmed = {k: v for k, v in full.items() if k != field}
    try:
        config = getattr(transformers, FAMILIES[family][0]).from_dict(trimmed)
        theirs = json.loads(config.to_json_string(use_diff=False))
        theirs["architectures"] = full["architectures"]
    except (ValueError, TypeError, StrictDataclassClassValidationError):
        theirs = None  # transformers refuses it too
    ours = _read(tmp_path / "trimmed", trimmed)
    if theirs is None:
        assert ours == "refused", f"{family} without {field}: transformers refuses it"
        return
    via_transformers = _read(tmp_path / "filled", theirs)
    # Ours may refuse where transformers would fall back to a full-size model's shape (a
    # required field missing): those weights would not fit anyway, and the message says so.
    assert ours in ("refused", via_transformers), f"{family} without {field}"


def test_an_absent_eos_is_the_class_default_only_without_a_generation_config(
        tmp_path: Path) -> None:
    """transformers reads config.json's eos (or its class default) only when there is no
    generation_config.json; with one, that file's ids are the stop tokens."""
    cfg = {k: v for k, v in _full_config("llama").items() if k != "eos_token_id"}
    assert _read(tmp_path, cfg).eos_token_ids == (2,)  # type: ignore[union-attr]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert _read(tmp_path, cfg).eos_token_ids == (7, 9)  # type: ignore[union-attr]


def test_the_plan_reads_the_filled_fields(tmp_path: Path) -> None:
    """`tandem plan` sizes KV pages from config.json: it sees the same defaults the worker does."""
    cfg = {k: v for k, v in _full_config("qwen3").items() if k != "head_dim"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert read_config_json(tmp_path / "config.json")["head_dim"] == 128


def test_gpt_oss_without_a_sliding_window_field_slides_128_like_transformers(
        tmp_path: Path) -> None:
    """The served case: GPT-OSS's sliding layers keep 128 tokens when config.json names no
    window; ours attended to every token, and a 150-token prompt's logits differed."""
    from tests.worker.gpt_oss_model import build_gpt_oss_checkpoint
    from tests.worker.test_arch_variants import engine_vs_transformers

    build_gpt_oss_checkpoint(tmp_path, seed=5)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["sliding_window"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_arch_config(tmp_path).layer_windows == (128, None, 128, None)
    ours, theirs, worst = engine_vs_transformers(tmp_path, lens=(150,), new=4)
    assert worst < 1e-4 and ours == theirs
