"""Read an HF `config.json` into the typed description our model code builds from.

Everything the Llama / Qwen2 / Qwen3 / Mistral family varies on is named here once, so the
model code never reads raw dicts: head_dim (explicit or hidden / heads), biases, Qwen3's q/k
norm, tied embeddings, per-layer sliding windows and the RoPE variant. Both spellings of
the RoPE settings are accepted: transformers >= 5 writes `rope_parameters` with `rope_theta`
inside; older checkpoints write top-level `rope_theta` plus an optional `rope_scaling`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from worker.arch.fp8_config import BlockFp8Config, Fp8Error, parse_quantization_config

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "GptOssForCausalLM",  # its own fields: worker/arch/gpt_oss_config.py
    "Qwen3NextForCausalLM",  # its own fields: worker/arch/qwen3_next_config.py
    "DeepseekV3ForCausalLM",  # config.json read by worker/arch/deepseek_config.py (see loader.py)
)
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


class ModelLoadError(ValueError):
    """A checkpoint cannot be loaded; the message names the file or field and the fix."""


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str  # one of ROPE_TYPES
    theta: float  # base wavelength
    factor: float = 1.0  # linear / dynamic / yarn / llama3 scaling factor
    original_max_position_embeddings: int = 0  # yarn / llama3: pre-extension context length
    max_position_embeddings: int = 0  # dynamic NTK: context length beyond which it scales
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: cos/sin multiplier (None = from factor)
    mscale: float | None = None  # yarn (DeepSeek-style attention_factor inputs)
    mscale_all_dim: float | None = None
    truncate: bool = True  # yarn: floor/ceil the correction range


@dataclass(frozen=True)
class MoEArch:
    """Qwen3-MoE's sparse layers: which layers, how many experts, how they are picked."""

    num_experts: int
    top_k: int  # num_experts_per_tok
    intermediate_size: int  # moe_intermediate_size: one expert's SwiGLU width
    norm_topk_prob: bool  # renormalize the top-k router probabilities to sum to 1
    sparse_layers: tuple[bool, ...]  # per layer: MoE block (True) or the dense MLP


@dataclass(frozen=True)
class ArchConfig:
    """The architecture knobs of one decoder-only checkpoint, from config.json."""

    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    qkv_bias: bool  # q/k/v projections carry a bias (Qwen2 always; others per attention_bias)
    o_bias: bool  # o_proj carries a bias (attention_bias on Llama / Qwen3)
    mlp_bias: bool  # Llama's mlp_bias
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    tie_word_embeddings: bool
    rope: RopeConfig
    layer_windows: tuple[int | None, ...]  # per layer: sliding window in tokens, None = full
    dtype: str  # the checkpoint's declared dtype: float32 | float16 | bfloat16
    eos_token_ids: tuple[int, ...]
    moe: MoEArch | None = None  # Qwen3-MoE; None = dense
    # Block-scaled FP8 checkpoint (quantization_config); None = unquantized weights. The loader
    # clears it where FP8 linears do not run (CPU: the weights are dequantized at load).
    quant: BlockFp8Config | None = None
    # A family's own typed fields, set by its parser (e.g. gpt_oss_config.GptOssArch,
    # deepseek_config.DeepseekArch, qwen3_next_config.Qwen3NextArch).
    family: Any = None

    @property
    def kv_latent_dim(self) -> int:
        """MLA: width of the one latent row per token per layer the KV cache keeps; 0 = K/V."""
        mla = getattr(self.family, "mla", None)  # DeepseekArch.mla
        return int(mla.latent_dim) if mla is not None else 0

    @property
    def context_limit(self) -> int:
        """The longest context the checkpoint serves (0 = no limit): see `scaled_context`."""
        return scaled_context(self.max_position_embeddings, self.rope.rope_type, self.rope.factor,
                              self.rope.original_max_position_embeddings)

    @property
    def sliding_window(self) -> int | None:
        windows = {w for w in self.layer_windows if w is not None}
        return max(windows) if windows else None


# config.json dtype names → the dtype's canonical name
DTYPES = {
    "float32": "float32",
    "float": "float32",
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
}


def _require(cfg: dict[str, Any], key: str, source: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ModelLoadError(
            f"{source}: required field {key!r} is missing; is this a decoder-only HF checkpoint?"
        )
    return cfg[key]


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_meaning(params: dict[str, Any], cfg: dict[str, Any],
                  default_theta: float) -> dict[str, Any]:
    """One RoPE dict as transformers completes it: `type` read as `rope_type`, rope_theta from
    the top level (else the class default) when the dict has none, numbers as numbers."""
    out = {k: float(v) if isinstance(v, int | float) and not isinstance(v, bool) else v
           for k, v in params.items() if k != "type"}
    out["rope_type"] = params.get("rope_type", params.get("type", "default"))
    out["rope_theta"] = float(params.get("rope_theta", cfg.get("rope_theta", default_theta)))
    return out


def rope_params(cfg: dict[str, Any], source: str | None = "config.json",
                default_theta: float = 10000.0) -> dict[str, Any]:
    """The RoPE dict transformers (>= 5) reads: `rope_scaling` when config.json has a non-empty
    one (the older spelling, and what model cards tell users to add for long context), else
    `rope_parameters`. Both given and meaning different things (a transformers-5 config with
    `rope_scaling` added by hand, say) is refused naming both: transformers would take
    rope_scaling and drop rope_parameters' rope_theta, which is rarely what was meant. `source`
    None skips that check (callers after the worker's parser, which already ran it)."""
    scaling, params = cfg.get("rope_scaling") or {}, cfg.get("rope_parameters") or {}
    if (source is not None and isinstance(scaling, dict) and isinstance(params, dict) and scaling
            and params and _rope_meaning(scaling, cfg, default_theta)
            != _rope_meaning(params, cfg, default_theta)):
        raise ModelLoadError(
            f"{source}: rope_scaling {scaling} and rope_parameters {params} disagree; "
            "transformers reads rope_scaling alone (and loses rope_parameters' rope_theta): "
            "keep one, e.g. move the scaling into rope_parameters and delete rope_scaling"
        )
    return dict(scaling or params)


def parse_rope(cfg: dict[str, Any], source: str, default_theta: float = 10000.0) -> RopeConfig:
    """Both spellings: `rope_parameters` (transformers >= 5) or `rope_theta` + `rope_scaling`;
    `default_theta` where neither names a rope_theta (the config class's default)."""
    params = rope_params(cfg, source, default_theta)
    per_layer_type = sorted(k for k, v in params.items() if isinstance(v, dict))
    if per_layer_type:  # read as one flat dict, it would silently fall back to the defaults
        raise ModelLoadError(
            f"{source}: rope_parameters per layer type ({', '.join(per_layer_type)}) are not "
            "supported; these families take one rope_parameters dict for every layer"
        )
    theta = float(params.get("rope_theta", cfg.get("rope_theta", default_theta)))
    # Old configs say "type", newer "rope_type"; "su"/"longrope" and others are not ours.
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: rope type {rope_type!r} is not supported; supported: "
            f"{', '.join(ROPE_TYPES)}"
        )
    max_pos = int(cfg.get("max_position_embeddings", 0) or 0)
    if params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) not in (
        1,
        1.0,
        None,
    ):
        raise ModelLoadError(f"{source}: partial_rotary_factor != 1 is not supported")
    factor = float(params.get("factor") or 1.0)
    for name, value in (("rope_theta", theta), ("factor", params.get("factor"))):
        if value is not None and float(value) <= 0:  # NaN frequencies, or `factor or 1.0` above
            raise ModelLoadError(f"{source}: RoPE {name} must be positive, got {value!r}")
    if rope_type in ("linear", "dynamic", "llama3") and "factor" not in params:
        raise ModelLoadError(
            f"{source}: rope type {rope_type!r} needs a 'factor' in rope_parameters/rope_scaling"
        )
    missing = [k for k in ("low_freq_factor", "high_freq_factor") if k not in params]
    if rope_type == "llama3" and missing:  # transformers refuses it too (no default is theirs)
        raise ModelLoadError(
            f"{source}: rope type 'llama3' needs {' and '.join(repr(k) for k in missing)} in "
            "rope_parameters/rope_scaling (Llama 3.1: low_freq_factor 1.0, high_freq_factor 4.0)"
        )
    orig = original_max_positions(cfg, params, rope_type, max_pos)
    if rope_type == "yarn" and params.get("factor") is None:
        factor = max_pos / orig  # transformers' fallback: the implied extension ratio
    return RopeConfig(
        rope_type=rope_type,
        theta=theta,
        factor=factor,
        original_max_position_embeddings=orig,
        max_position_embeddings=max_pos,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )


def original_max_positions(cfg: dict[str, Any], params: dict[str, Any], rope_type: str,
                           max_pos: int) -> int:
    """The pre-extension context length, where transformers' `standardize_rope_params` finds it:
    for yarn / llama3 a top-level `original_max_position_embeddings` (Phi-3 style) outranks the
    one in rope_parameters; otherwise the nested one, then the top-level one, then max_pos."""
    top = cfg.get("original_max_position_embeddings")
    nested = params.get("original_max_position_embeddings")
    first = (top, nested) if rope_type in ("yarn", "llama3") else (nested, top)
    return int(first[0] or first[1] or max_pos)


def scaled_context(max_pos: int, rope_type: str, factor: float, original: int) -> int:
    """max_position_embeddings extended by the RoPE scaling, as vLLM derives max_model_len:
    linear and dynamic NTK scale it by `factor`, YaRN scales `original_max_position_embeddings`;
    llama3's max_position_embeddings already counts its extension. Never below max_pos (a YaRN
    config whose max_position_embeddings is already the extended length keeps it); 0 = none."""
    if not max_pos:
        return 0
    if rope_type in ("linear", "dynamic"):
        return max(max_pos, int(max_pos * factor))
    if rope_type == "yarn":
        return max(max_pos, int((original or max_pos) * factor))
    return max_pos


def context_limit(cfg: dict[str, Any]) -> int:
    """`ArchConfig.context_limit` of a raw config.json (`tandem plan` reads shapes without a
    family parser): the same rule over the same fields, both RoPE spellings."""
    max_pos = int(cfg.get("max_position_embeddings") or 0)
    params = rope_params(cfg, None)
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    original = original_max_positions(cfg, params, rope_type, max_pos)
    factor = params.get("factor")
    if factor is None:  # parse_rope's yarn fallback: the ratio the config implies (no extension)
        factor = max_pos / original if rope_type == "yarn" and original else 1.0
    return scaled_context(max_pos, rope_type, float(factor), original)


# transformers' Llama and Qwen3-Next attend to every earlier token: a `sliding_window` in their
# config.json (left from a Mistral conversion, say) is not read, so it must not be read here.
_NO_WINDOW_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3NextForCausalLM")


def window_tokens(window: Any, source: str) -> int:
    """A sliding_window that is read: at least one token (a window of none attends to nothing)."""
    if int(window) < 1:
        raise ModelLoadError(
            f"{source}: sliding_window must be at least 1 token, got {window!r}; set it to the "
            "window the model was trained with, or null for full attention"
        )
    return int(window)


def layer_windows(cfg: dict[str, Any], arch: str, num_layers: int,
                  source: str = "config.json") -> tuple[int | None, ...]:
    """Which layers attend through a sliding window, following transformers' rules per family."""
    window = None if arch in _NO_WINDOW_ARCHITECTURES else cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM") and not cfg.get(
        "use_sliding_window", False
    ):
        window = None  # Qwen configs carry a window value that is off unless use_sliding_window
    if window is None:
        return (None,) * num_layers
    window = window_tokens(window, source)
    if layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        first = int(cfg.get("max_window_layers", num_layers))
        return tuple(window if i >= first else None for i in range(num_layers))
    return (window,) * num_layers


def parse_arch_config(
    cfg: dict[str, Any], generation_cfg: dict[str, Any] | None = None, source: str = "config.json"
) -> ArchConfig:
    """Validate and type one config.json (plus generation_config.json for eos ids)."""
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"{source}: architectures={archs!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    hidden = int(_require(cfg, "hidden_size", source))
    heads = int(_require(cfg, "num_attention_heads", source))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    if heads % kv_heads:
        raise ModelLoadError(
            f"{source}: num_attention_heads ({heads}) must be a multiple of "
            f"num_key_value_heads ({kv_heads})"
        )
    num_layers = int(_require(cfg, "num_hidden_layers", source))
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ModelLoadError(
            f"{source}: hidden_act {cfg.get('hidden_act')!r} is not supported "
            "(SwiGLU with silu only)"
        )
    dtype_name = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32").replace("torch.", "")
    if dtype_name not in DTYPES:
        raise ModelLoadError(
            f"{source}: dtype {dtype_name!r} is not supported; use float32, bfloat16 or float16"
        )
    # Read only by the families whose transformers model reads it (Mistral's projections have no
    # biases; only Llama's MLP has mlp_bias): a stray `true` must not ask for absent tensors.
    attention_bias = bool(cfg.get("attention_bias", False)) and arch != "MistralForCausalLM"
    is_qwen2 = arch == "Qwen2ForCausalLM"
    eos = _as_id_tuple((generation_cfg or {}).get("eos_token_id")) + _as_id_tuple(
        cfg.get("eos_token_id")
    )
    try:
        quant = parse_quantization_config(cfg.get("quantization_config"), source)
    except Fp8Error as exc:
        raise ModelLoadError(str(exc)) from None
    return ArchConfig(
        architecture=arch,
        num_layers=num_layers,
        hidden_size=hidden,
        intermediate_size=int(_require(cfg, "intermediate_size", source)),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=int(_require(cfg, "vocab_size", source)),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 0),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        qkv_bias=True if is_qwen2 else attention_bias,
        o_bias=False if is_qwen2 else attention_bias,
        mlp_bias=arch == "LlamaForCausalLM" and bool(cfg.get("mlp_bias", False)),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope=parse_rope(cfg, source),
        layer_windows=layer_windows(cfg, arch, num_layers, source),
        dtype=DTYPES[dtype_name],
        eos_token_ids=tuple(dict.fromkeys(eos)),  # union, order kept, no duplicates
        moe=parse_moe(cfg, num_layers, source) if arch == "Qwen3MoeForCausalLM" else None,
        quant=quant,
    )


def parse_moe(cfg: dict[str, Any], num_layers: int, source: str) -> MoEArch:
    """Qwen3-MoE: layer i is sparse unless listed in mlp_only_layers, every decoder_sparse_step-th.
    """
    experts = int(
        cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    )  # transformers 5 writes the latter
    if experts <= 0:
        raise ModelLoadError(
            f"{source}: Qwen3MoeForCausalLM needs num_experts (or num_local_experts) > 0"
        )
    top_k = int(_require(cfg, "num_experts_per_tok", source))
    if not 0 < top_k <= experts:
        raise ModelLoadError(
            f"{source}: num_experts_per_tok ({top_k}) must be in [1, num_experts={experts}]"
        )
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    return MoEArch(
        num_experts=experts,
        top_k=top_k,
        intermediate_size=int(_require(cfg, "moe_intermediate_size", source)),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers)),
    )
