"""GPT-OSS's config.json (`GptOssForCausalLM`): what it adds to the shared `ArchConfig`.

`parse_arch_config` (worker/arch/hf_config.py) reads the knobs every decoder shares; this
module fills in what GPT-OSS means by them and what only it has, following transformers'
`GptOssConfig` defaults where a field is absent:

- attention: q/k/v/o biases (`attention_bias`, default true), a learned sink per head (implied
  by the architecture), `layer_types` alternating sliding / full (default: even layers slide),
  one `sliding_window`, YaRN RoPE (default factor 32 over 4096 positions, theta 150000);
- MoE in every layer: `num_local_experts`, `num_experts_per_tok`, each expert `intermediate_size`
  wide, a biased router whose top-k logits are softmaxed (the same as renormalized top-k
  probabilities), and the clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`).

MXFP4 checkpoints (`quantization_config`, as openai/gpt-oss-* ship) are refused with one line:
their expert weights are `*_blocks` / `*_scales` tensors that this loader does not decode yet.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from worker.arch.hf_config import (
    ArchConfig,
    ModelLoadError,
    MoEArch,
    parse_arch_config,
    parse_rope,
    window_tokens,
)

ARCHITECTURE = "GptOssForCausalLM"
# transformers' GptOssConfig defaults, used only when config.json leaves a field out.
DEFAULT_THETA = 150000.0  # GptOssConfig.default_theta: where no RoPE dict names a rope_theta
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
    "rope_theta": DEFAULT_THETA,
}
DEFAULT_SWIGLU_ALPHA = 1.702
DEFAULT_SWIGLU_LIMIT = 7.0


@dataclass(frozen=True)
class GptOssArch:
    """The knobs only GPT-OSS has (ArchConfig.family of a GptOssForCausalLM)."""

    swiglu_alpha: float  # gain inside the sigmoid: gate * sigmoid(alpha * gate)
    swiglu_limit: float  # gate clamped to <= limit, up to [-limit, limit], before the GLU


def gpt_oss_layer_windows(cfg: dict[str, Any], num_layers: int,
                          source: str) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
    ]
    if len(types) != num_layers:
        raise ModelLoadError(
            f"{source}: layer_types lists {len(types)} layers but num_hidden_layers is "
            f"{num_layers}; give one entry per layer"
        )
    unknown = sorted({t for t in types} - {"sliding_attention", "full_attention"})
    if unknown:
        raise ModelLoadError(
            f"{source}: layer_types has {unknown}; GPT-OSS layers are sliding_attention or "
            "full_attention"
        )
    if window is None:
        return (None,) * num_layers
    size = window_tokens(window, source)
    return tuple(size if t == "sliding_attention" else None for t in types)


def parse_gpt_oss_config(cfg: dict[str, Any], generation_cfg: dict[str, Any] | None = None,
                         source: str = "config.json") -> ArchConfig:
    """Validate a GptOssForCausalLM config.json: its release format first (MXFP4, refused with
    the fix), then the shared fields, then its family's."""
    quant = cfg.get("quantization_config")
    method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
    if quant and method not in ("fp8", "compressed-tensors"):  # those: fp8_config.py
        raise ModelLoadError(
            f"{source}: quantization_config (quant_method {method!r}) is not supported: MXFP4 "
            "expert weights cannot be loaded yet; use a dequantized bfloat16/float32 "
            "GptOssForCausalLM checkpoint"
        )
    return refine_gpt_oss(parse_arch_config(cfg, generation_cfg, source), cfg, source)


def refine_gpt_oss(arch: ArchConfig, cfg: dict[str, Any], source: str) -> ArchConfig:
    """The shared `ArchConfig` of a GPT-OSS config.json, completed with its family's meaning."""
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if experts <= 0 or not 0 < top_k <= experts:
        raise ModelLoadError(
            f"{source}: GptOssForCausalLM needs num_local_experts > 0 and num_experts_per_tok in "
            f"[1, num_local_experts]; got {experts} and {top_k}"
        )
    limit = float(cfg.get("swiglu_limit", DEFAULT_SWIGLU_LIMIT))
    if limit <= 0:
        raise ModelLoadError(f"{source}: swiglu_limit must be > 0 (GPT-OSS uses 7.0); got {limit}")
    # GptOssConfig's defaults: its YaRN when config.json names no RoPE at all, and its rope_theta
    # (150000, not the 10000 of the other families) where the RoPE dict and the top level name none
    has_rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    rope = (parse_rope(cfg, source, default_theta=DEFAULT_THETA) if has_rope
            else parse_rope({**cfg, "rope_parameters": DEFAULT_ROPE}, source))
    bias = bool(cfg.get("attention_bias", True))
    return dataclasses.replace(
        arch,
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=False,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope=rope,
        layer_windows=gpt_oss_layer_windows(cfg, arch.num_layers, source),
        moe=MoEArch(
            num_experts=experts,
            top_k=top_k,
            intermediate_size=arch.intermediate_size,
            # A softmax over the chosen logits = the renormalized top-k probabilities.
            norm_topk_prob=True,
            sparse_layers=(True,) * arch.num_layers,
        ),
        family=GptOssArch(
            swiglu_alpha=float(cfg.get("swiglu_alpha", DEFAULT_SWIGLU_ALPHA)), swiglu_limit=limit
        ),
    )
