"""Qwen3-Next's config.json fields, typed: which layers are Gated DeltaNet, their head shapes,
the partial rotary, the shared expert.

The fields every decoder has (hidden size, heads, RoPE base, eos ids, the routed experts) go
through the shared parser (worker/arch/hf_config.py); what only this family has is parsed
here into `Qwen3NextArch`, carried in `ArchConfig.family`. transformers' rules are followed:
`layer_types` (or, when absent, every `full_attention_interval`-th layer is full attention,
default 4); layer i is sparse MoE unless in `mlp_only_layers`, when `num_experts > 0` and
`(i + 1) % decoder_sparse_step == 0`; RoPE rotates the first `partial_rotary_factor * head_dim`
dims of each q/k head (default 0.25).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from worker.arch.hf_config import (
    ArchConfig,
    ModelLoadError,
    parse_arch_config,
    parse_moe,
    rope_params,
)

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True)
class Qwen3NextArch:
    """Qwen3-Next's own knobs (whole-model numbers; a TP rank divides the head counts)."""

    linear_layers: tuple[bool, ...]  # per layer: True = Gated DeltaNet, False = gated attention
    num_k_heads: int  # linear_num_key_heads: q/k heads of a DeltaNet layer
    num_v_heads: int  # linear_num_value_heads: v heads (a multiple of num_k_heads)
    head_k_dim: int  # linear_key_head_dim
    head_v_dim: int  # linear_value_head_dim
    conv_kernel: int  # linear_conv_kernel_dim: taps of the causal depthwise conv
    rotary_dim: int  # dims of each full-attention q/k head that RoPE rotates (even)
    shared_expert_intermediate_size: int  # the MoE's always-on expert (0 = dense model)
    # mtp_num_hidden_layers: multi-token-prediction layers the checkpoint declares (`mtp.*`);
    # speculative.method=mtp drafts with the first (loaded only when the checkpoint has them)
    num_mtp_layers: int = 0

    @property
    def state_layers(self) -> tuple[int, ...]:
        return tuple(i for i, linear in enumerate(self.linear_layers) if linear)

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q | k | v of every head (the model's, not one rank's)."""
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim


def _int(cfg: dict[str, Any], key: str, default: int, source: str) -> int:
    value = cfg.get(key, default)
    if not isinstance(value, int) or value <= 0:
        raise ModelLoadError(f"{source}: {key} must be a positive integer, got {value!r}")
    return value


def _layer_kinds(cfg: dict[str, Any], num_layers: int, source: str) -> tuple[bool, ...]:
    types = cfg.get("layer_types")
    if types is None:
        every = _int(cfg, "full_attention_interval", 4, source)
        return tuple((i + 1) % every != 0 for i in range(num_layers))
    if len(types) != num_layers or any(t not in (LINEAR, FULL) for t in types):
        raise ModelLoadError(
            f"{source}: layer_types must list {num_layers} entries (num_hidden_layers), each "
            f"{LINEAR!r} or {FULL!r}; got {types!r}")
    return tuple(t == LINEAR for t in types)


def parse_qwen3_next_config(
    cfg: dict[str, Any], generation_cfg: dict[str, Any] | None = None, source: str = "config.json"
) -> ArchConfig:
    """Validate a Qwen3NextForCausalLM config.json into an ArchConfig with `family` set."""
    params = rope_params(cfg, source)
    factor = float(params.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    # The shared parser refuses partial rotary (the Llama family has none); this family
    # handles it, so the shared fields are parsed from a copy without it.
    shared = {k: v for k, v in cfg.items()
              if k not in ("partial_rotary_factor", "rope_scaling", "rope_parameters")}
    shared["rope_parameters"] = params
    arch = parse_arch_config(shared, generation_cfg, source)
    head_dim = arch.head_dim
    rotary_dim = int(head_dim * factor)
    if not 0 < factor <= 1 or rotary_dim % 2:
        raise ModelLoadError(
            f"{source}: partial_rotary_factor {factor} gives {rotary_dim} rotary dims of head_dim "
            f"{head_dim}; it must be in (0, 1] and give an even number of dims")
    family = Qwen3NextArch(
        linear_layers=_layer_kinds(cfg, arch.num_layers, source),
        num_k_heads=_int(cfg, "linear_num_key_heads", 16, source),
        num_v_heads=_int(cfg, "linear_num_value_heads", 32, source),
        head_k_dim=_int(cfg, "linear_key_head_dim", 128, source),
        head_v_dim=_int(cfg, "linear_value_head_dim", 128, source),
        conv_kernel=_int(cfg, "linear_conv_kernel_dim", 4, source),
        rotary_dim=rotary_dim,
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
        num_mtp_layers=int(cfg.get("mtp_num_hidden_layers") or cfg.get("num_nextn_predict_layers")
                           or 0),
    )
    if family.num_v_heads % family.num_k_heads:
        raise ModelLoadError(
            f"{source}: linear_num_value_heads ({family.num_v_heads}) must be a multiple of "
            f"linear_num_key_heads ({family.num_k_heads})")
    experts = int(cfg.get("num_experts") or 0)
    moe = parse_moe(cfg, arch.num_layers, source) if experts > 0 else None
    if moe is not None and family.shared_expert_intermediate_size <= 0:
        raise ModelLoadError(
            f"{source}: shared_expert_intermediate_size must be > 0 with num_experts > 0")
    return dataclasses.replace(arch, qk_norm=True, moe=moe, family=family)
