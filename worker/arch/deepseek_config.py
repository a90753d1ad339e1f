"""DeepSeek-V3's config.json (`DeepseekV3ForCausalLM`) read into the shared `ArchConfig`.

What the family adds to the dense decoder's knobs, named once here:

- MLA (multi-head latent attention): queries through a low-rank bottleneck (q_a_proj,
  q_a_layernorm, q_b_proj; or a plain q_proj when `q_lora_rank` is null), keys and values
  compressed to one latent of `kv_lora_rank` elements per token plus one rope key of
  `qk_rope_head_dim` shared by every head (kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj). The
  KV cache keeps only that latent, so for the engine the model has one kv "head" of width
  `kv_lora_rank + qk_rope_head_dim` (`ArchConfig.num_kv_heads = 1`, `head_dim = latent_dim`).
- The softmax scale: `qk_head_dim ** -0.5`, times YaRN's mscale(factor, mscale_all_dim)^2 when
  the rope is scaled (transformers' `yarn_apply_mscale`); the rope itself covers only the
  `qk_rope_head_dim` slice, in DeepSeek's interleaved pair layout when `rope_interleave`.
- MoE: sigmoid router scores, a per-expert `e_score_correction_bias` that steers the choice
  (not the weights), grouped top-k (`n_group` groups scored by their best two experts,
  `topk_group` groups kept), `norm_topk_prob`, `routed_scaling_factor`, `n_shared_experts`
  always-on experts, and dense MLPs in the first `first_k_dense_replace` layers.
- MTP: `num_nextn_predict_layers` multi-token-prediction layers stored after the decoder
  layers (`model.layers.{num_hidden_layers + k}.*`), loaded when the checkpoint has them.
- FP8: DeepSeek's own release is block-scaled e4m3 (`quantization_config`, read by
  fp8_config.py into `ArchConfig.quant`); which linears keep FP8 is worker/model/mla.py's and
  deepseek_v3.py's business (docs/mla.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from worker.arch.fp8_config import Fp8Error, parse_quantization_config
from worker.arch.hf_config import (
    DTYPES,
    ArchConfig,
    ModelLoadError,
    MoEArch,
    RopeConfig,
    _as_id_tuple,
    _require,
    parse_rope,
)

ARCHITECTURE = "DeepseekV3ForCausalLM"


@dataclass(frozen=True)
class MLAArch:
    """The attention of one DeepSeek layer (every layer has the same)."""

    q_lora_rank: int | None  # None: q_proj straight from the hidden state (no q bottleneck)
    kv_lora_rank: int  # compressed kv: the part of the latent that kv_b_proj expands
    qk_nope_head_dim: int  # per head: query/key features without position
    qk_rope_head_dim: int  # per head (query) / shared (key): the rotary features
    v_head_dim: int
    rope_interleave: bool  # rotary pairs are (x0, x1), (x2, x3), ...; else rotate-half
    softmax_scale: float  # qk_head_dim ** -0.5, times YaRN's mscale^2 under a scaled rope

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """What the KV cache keeps per token per layer: compressed kv, then the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class DeepseekArch:
    """DeepSeek-V3's own knobs beside `ArchConfig` (whose `moe` holds the expert shapes)."""

    mla: MLAArch
    n_group: int  # expert groups for grouped top-k routing
    topk_group: int  # groups kept per token
    routed_scaling_factor: float  # multiplies the routed experts' weights
    n_shared_experts: int  # always-on experts, one SwiGLU of n_shared * moe_intermediate_size
    num_mtp_layers: int  # num_nextn_predict_layers: MTP layers after the decoder layers


def _positive(cfg: dict[str, Any], key: str, source: str) -> int:
    value = int(_require(cfg, key, source))
    if value <= 0:
        raise ModelLoadError(f"{source}: {key} must be > 0, got {value}")
    return value


def softmax_scale(qk_head_dim: int, rope: RopeConfig) -> float:
    """qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim)^2 for a scaled rope: YaRN's
    attention temperature that DeepSeek puts in the softmax rather than in cos/sin."""
    scale = qk_head_dim**-0.5
    if rope.rope_type != "default" and rope.mscale_all_dim and rope.factor > 1:
        m = 0.1 * float(rope.mscale_all_dim) * math.log(rope.factor) + 1.0
        scale *= m * m
    return scale


def parse_mla(cfg: dict[str, Any], rope: RopeConfig, source: str) -> MLAArch:
    q_lora = cfg.get("q_lora_rank")
    if q_lora is not None and int(q_lora) <= 0:
        raise ModelLoadError(
            f"{source}: q_lora_rank must be > 0 or null (no query bottleneck), got {q_lora}"
        )
    nope = _positive(cfg, "qk_nope_head_dim", source)
    rope_dim = _positive(cfg, "qk_rope_head_dim", source)
    if rope_dim % 2:
        raise ModelLoadError(
            f"{source}: qk_rope_head_dim must be even (rotary pairs), got {rope_dim}"
        )
    return MLAArch(
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=_positive(cfg, "kv_lora_rank", source),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=_positive(cfg, "v_head_dim", source),
        rope_interleave=bool(cfg.get("rope_interleave", True)),
        softmax_scale=softmax_scale(nope + rope_dim, rope),
    )


def parse_moe(cfg: dict[str, Any], num_layers: int, source: str) -> MoEArch | None:
    """Routed experts in layers >= first_k_dense_replace; None when the model has none."""
    experts = int(cfg.get("n_routed_experts") or 0)
    if experts == 0:
        return None
    if int(cfg.get("moe_layer_freq", 1) or 1) != 1:
        raise ModelLoadError(
            f"{source}: moe_layer_freq != 1 is not supported (every layer from "
            "first_k_dense_replace on is MoE in DeepSeek-V3)"
        )
    top_k = _positive(cfg, "num_experts_per_tok", source)
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    return MoEArch(
        num_experts=experts,
        top_k=top_k,
        intermediate_size=_positive(cfg, "moe_intermediate_size", source),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        sparse_layers=tuple(i >= first_dense for i in range(num_layers)),
    )


def _check_routing(
    cfg: dict[str, Any], moe: MoEArch, n_group: int, topk_group: int, source: str
) -> None:
    """The grouped top-k rules transformers' router relies on, refused here with the fix."""
    for key, want in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
        if cfg.get(key, want) != want:
            raise ModelLoadError(
                f"{source}: {key}={cfg[key]!r} is not supported; DeepSeek-V3 routes "
                f"with {key}={want!r} (DeepSeek-V2's softmax routers are not built)"
            )
    e = moe.num_experts
    if e % n_group or e // n_group < 2:
        raise ModelLoadError(
            f"{source}: n_routed_experts ({e}) must split into n_group ({n_group}) "
            "groups of at least 2 experts (a group is scored by its best two)"
        )
    if not 0 < topk_group <= n_group:
        raise ModelLoadError(
            f"{source}: topk_group ({topk_group}) must be in [1, n_group={n_group}]"
        )
    if moe.top_k > topk_group * (e // n_group):
        raise ModelLoadError(
            f"{source}: num_experts_per_tok ({moe.top_k}) exceeds the experts of the "
            f"topk_group={topk_group} kept groups ({topk_group * (e // n_group)})"
        )


def parse_deepseek_v3(
    cfg: dict[str, Any], generation_cfg: dict[str, Any] | None, source: str
) -> ArchConfig:
    """Validate and type a DeepseekV3ForCausalLM config.json."""
    hidden = _positive(cfg, "hidden_size", source)
    heads = _positive(cfg, "num_attention_heads", source)
    num_layers = _positive(cfg, "num_hidden_layers", source)
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ModelLoadError(
            f"{source}: hidden_act {cfg.get('hidden_act')!r} is not supported (SwiGLU with silu)"
        )
    dtype_name = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32").replace("torch.", "")
    if dtype_name not in DTYPES:
        raise ModelLoadError(
            f"{source}: dtype {dtype_name!r} is not supported; use float32, bfloat16 or float16"
        )
    try:  # DeepSeek's release: e4m3 blocks with `<name>.weight_scale_inv` beside each weight
        quant = parse_quantization_config(cfg.get("quantization_config"), source)
    except Fp8Error as exc:
        raise ModelLoadError(str(exc)) from None
    rope = parse_rope(cfg, source)
    mla = parse_mla(cfg, rope, source)
    moe = parse_moe(cfg, num_layers, source)
    n_group = int(cfg.get("n_group") or 1)
    topk_group = int(cfg.get("topk_group") or n_group)
    if moe is not None:
        _check_routing(cfg, moe, n_group, topk_group, source)
    mtp = int(cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers", 0)) or 0)
    bias = bool(cfg.get("attention_bias", False))
    eos = _as_id_tuple((generation_cfg or {}).get("eos_token_id")) + _as_id_tuple(
        cfg.get("eos_token_id")
    )
    return ArchConfig(
        architecture=ARCHITECTURE,
        num_layers=num_layers,
        hidden_size=hidden,
        intermediate_size=_positive(cfg, "intermediate_size", source),
        num_heads=heads,
        num_kv_heads=1,  # the latent: one kv "head" shared by every query head (see module doc)
        head_dim=mla.latent_dim,
        vocab_size=_positive(cfg, "vocab_size", source),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 0),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        qkv_bias=bias,  # q_a_proj and kv_a_proj_with_mqa
        o_bias=bias,
        mlp_bias=False,
        qk_norm=False,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope=rope,
        layer_windows=(None,) * num_layers,
        dtype=DTYPES[dtype_name],
        eos_token_ids=tuple(dict.fromkeys(eos)),
        moe=moe,
        quant=quant,
        family=DeepseekArch(
            mla=mla,
            n_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0) or 1.0),
            n_shared_experts=int(cfg.get("n_shared_experts") or 0),
            num_mtp_layers=max(0, mtp),
        ),
    )
