"""The tiny GPT-OSS checkpoint the GPT-OSS tests share (built into a temp dir, never committed).

`GptOssConfig(...)` → `GptOssForCausalLM(config)` → `save_pretrained` in float32, offline, plus
the embedded model's tokenizer files (models/tandem-arith) so a gateway can serve it.

The shape exercises what matters: 4 layers alternating sliding (window 8 = 2 pages of 4) and
full attention, 4 query heads over 2 kv heads (one per rank at TP=2), 4 experts (two per rank
at EP=2) with top-2 routing, YaRN RoPE that really rescales (factor 4 over 64 positions), and a
wide init. transformers initializes the expert biases to zero and the sinks small; here they
are drawn wide, and `swiglu_limit` is low, so sinks, biases and both clamps change the output.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

WINDOW = 8
NUM_LAYERS = 4
EMBEDDED = Path(__file__).resolve().parents[2] / "models" / "tandem-arith"
TINY_GPT_OSS = dict(
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=NUM_LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    max_position_embeddings=256,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=WINDOW,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
    swiglu_limit=1.5,
    pad_token_id=0,
    eos_token_id=2,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 64,
        "rope_theta": 150000.0,
    },
)


def build_gpt_oss_checkpoint(path: Path, seed: int = 0, **overrides: object) -> torch.nn.Module:
    """Save a tiny random GptOssForCausalLM at `path` (+ tokenizer files); return the HF model."""
    import transformers

    config = transformers.GptOssConfig(**{**TINY_GPT_OSS, **overrides})
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.5)  # some heads mostly attend to nothing
            layer.mlp.router.bias.normal_(0.0, 0.5)
            layer.mlp.experts.gate_up_proj_bias.normal_(0.0, 0.5)
            layer.mlp.experts.down_proj_bias.normal_(0.0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED / name, Path(path) / name)
    return model
