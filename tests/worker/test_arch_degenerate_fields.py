"""config.json values that no model can be served with, refused at load in one line naming the
field (found by a reviewer's sweep of transformers-written checkpoints with edited configs).

Before, each loaded and served: `sliding_window: 0` (with use_sliding_window on, or on Mistral /
GPT-OSS) gave a window of no tokens, served as tokens from nothing (transformers' generate
raises on it); `rope_theta: 0` gave NaN frequencies and every greedy token was id 0; a RoPE
`factor` of 0 was read as 1 (`factor or 1.0`), so a linear-scaled config served unscaled
positions while transformers divides by it (NaN).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.worker.test_arch_variants import LLAMA_CFG
from worker.arch.hf_config import ModelLoadError, parse_arch_config
from worker.arch.load import config_layer_windows

WINDOW_ZERO = {"sliding_window": 0, "use_sliding_window": True}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2-window-0": ("Qwen2ForCausalLM", WINDOW_ZERO),
    "mistral-window-negative": ("MistralForCausalLM", {"sliding_window": -4}),
    "gpt-oss-window-0": ("GptOssForCausalLM", {
        "sliding_window": 0, "num_local_experts": 4, "num_experts_per_tok": 2,
        "head_dim": 16}),
    "rope-theta-0": ("LlamaForCausalLM", {"rope_parameters": {"rope_type": "default",
                                                              "rope_theta": 0}}),
    "old-rope-theta-negative": ("Qwen3ForCausalLM", {"rope_parameters": None,
                                                     "rope_theta": -1e4}),
    "linear-factor-0": ("LlamaForCausalLM", {"rope_parameters": {
        "rope_type": "linear", "factor": 0.0, "rope_theta": 1e4}}),
    "yarn-factor-negative": ("Qwen3ForCausalLM", {"rope_parameters": {
        "rope_type": "yarn", "factor": -2.0, "rope_theta": 1e4,
        "original_max_position_embeddings": 64}}),
}
FIELD = {"qwen2-window-0": "sliding_window", "mistral-window-negative": "sliding_window",
         "gpt-oss-window-0": "sliding_window", "rope-theta-0": "rope_theta",
         "old-rope-theta-negative": "rope_theta", "linear-factor-0": "factor",
         "yarn-factor-negative": "factor"}


@pytest.mark.parametrize("case", list(CASES))
def test_a_value_no_model_serves_is_refused_naming_the_field(case: str) -> None:
    arch, fields = CASES[case]
    cfg = {**LLAMA_CFG, "architectures": [arch], **fields}
    if arch == "GptOssForCausalLM":
        from worker.arch.gpt_oss_config import parse_gpt_oss_config as parse
    else:
        parse = parse_arch_config
    with pytest.raises(ModelLoadError) as exc:
        parse(cfg, source="ckpt/config.json")
    message = str(exc.value)
    assert message.startswith("ckpt/config.json: ") and FIELD[case] in message, message
    assert "\n" not in message
    if FIELD[case] == "sliding_window":  # the planner's reading refuses it too
        with pytest.raises(ModelLoadError, match="sliding_window"):
            config_layer_windows(cfg, "ckpt/config.json")


@pytest.mark.parametrize("fields", [
    {"sliding_window": 0, "use_sliding_window": False},  # Qwen: the window is off, its value unread
    {"rope_parameters": {"rope_type": "linear", "factor": 0.5, "rope_theta": 1e4}},  # compresses
])
def test_values_transformers_serves_still_load(fields: dict[str, Any]) -> None:
    parse_arch_config({**LLAMA_CFG, "architectures": ["Qwen2ForCausalLM"], **fields})
