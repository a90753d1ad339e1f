"""What a config.json means by a field it leaves out: transformers' config-class default.

transformers builds its config from config.json with the class's defaults for absent fields,
and those differ by family: an absent `sliding_window` is a 4096-token window on Mistral (and
on Qwen with use_sliding_window) and a 128-token one on GPT-OSS's sliding layers; Qwen3's
absent head_dim is 128, not hidden / heads; DeepSeek-V3 scales its routed experts by 2.5. Our
parsers' own fallbacks ("off", "derived", 1.0) would serve such a trimmed or hand-written
config.json differently from transformers, silently where the weights still fit. So every
reader of config.json (the worker's parsers and `tandem plan`) first fills the absent fields
from this table. An explicit `null` is left alone: transformers reads it as null too.

Only fields we read and whose class default differs from our fallback are listed; the shape
fields (hidden_size, num_hidden_layers, ...) are not: a full-size default would not fit the
weights, and the parsers refuse their absence with one line. tests/worker/test_absent_fields.py
checks the table against transformers' classes.
"""

from __future__ import annotations

from typing import Any

_QWEN_WINDOW = {"sliding_window": 4096, "max_window_layers": 28}  # read with use_sliding_window

ABSENT_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"max_position_embeddings": 2048},
    "MistralForCausalLM": {"max_position_embeddings": 131072, "num_key_value_heads": 8,
                           "sliding_window": 4096},
    "Qwen2ForCausalLM": {"max_position_embeddings": 32768, "num_key_value_heads": 32,
                         **_QWEN_WINDOW},
    "Qwen3ForCausalLM": {"max_position_embeddings": 32768, "num_key_value_heads": 32,
                         "head_dim": 128, **_QWEN_WINDOW},
    "Qwen3MoeForCausalLM": {"max_position_embeddings": 32768, "num_key_value_heads": 4,
                            "sliding_window": 4096},
    "GptOssForCausalLM": {"max_position_embeddings": 131072, "num_key_value_heads": 8,
                          "head_dim": 64, "sliding_window": 128},
    "Qwen3NextForCausalLM": {"max_position_embeddings": 32768, "num_key_value_heads": 2,
                             "head_dim": 256, "norm_topk_prob": True, "num_experts": 512,
                             "num_experts_per_tok": 10, "moe_intermediate_size": 512,
                             "shared_expert_intermediate_size": 512},
    # n_group / topk_group: grouped routing (8 groups, the best 4 kept); ours read an absent
    # n_group as 1 and an absent topk_group as n_group, i.e. no group restriction at all
    "DeepseekV3ForCausalLM": {"max_position_embeddings": 4096, "first_k_dense_replace": 3,
                              "n_group": 8, "topk_group": 4,
                              "n_routed_experts": 256, "n_shared_experts": 1,
                              "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
                              "routed_scaling_factor": 2.5},
}

# The stop token an absent eos_token_id means. transformers reads it only when the checkpoint has
# no generation_config.json (GenerationConfig.from_model_config); otherwise that file decides.
ABSENT_EOS = {"LlamaForCausalLM": 2, "MistralForCausalLM": 2, "DeepseekV3ForCausalLM": 1}


def with_absent_defaults(cfg: dict[str, Any], has_generation_config: bool = True
                         ) -> dict[str, Any]:
    """`cfg` with the absent fields its architecture's transformers config class fills in."""
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in ABSENT_DEFAULTS), None)
    if arch is None:
        return cfg
    eos = {} if has_generation_config or arch not in ABSENT_EOS else {
        "eos_token_id": ABSENT_EOS[arch]}
    return {**ABSENT_DEFAULTS[arch], **eos, **cfg}
