"""The JSON types of the config.json fields our parsers read, checked before any parser runs.

The families' parsers convert fields with int(), float() and bool(): a string where a number
belongs would end in a Python error deep inside one of them, and `"tie_word_embeddings":
"false"` would read as true. Checked here first (`load.load_arch_config`, which the worker,
the launcher and `tandem plan` all run), a field of the wrong type is one line naming the file,
the field, the type it must have and what it holds. An explicit null is left to the parsers:
transformers reads it as absent, and so do they.
"""

from __future__ import annotations

from typing import Any

from worker.arch.hf_config import ModelLoadError

# Shapes: positive integers (as the launcher's config.json check has them).
_POSITIVE_INTS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size",
                  "intermediate_size", "num_key_value_heads", "head_dim",
                  "max_position_embeddings")
_INTS = ("max_window_layers", "decoder_sparse_step", "first_k_dense_replace", "moe_layer_freq",
         "mtp_num_hidden_layers", "n_group", "n_routed_experts", "n_shared_experts",
         "num_experts", "num_local_experts", "num_nextn_predict_layers", "num_experts_per_tok",
         "shared_expert_intermediate_size", "topk_group", "moe_intermediate_size", "q_lora_rank",
         "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "sliding_window",
         "original_max_position_embeddings")
_NUMBERS = ("rms_norm_eps", "rope_theta", "partial_rotary_factor", "routed_scaling_factor",
            "swiglu_alpha", "swiglu_limit")
_BOOLS = ("attention_bias", "mlp_bias", "norm_topk_prob", "rope_interleave",
          "tie_word_embeddings", "use_sliding_window")
_MAPPINGS = ("rope_parameters", "rope_scaling", "quantization_config")
_STRING_LISTS = ("architectures", "layer_types")
# rope_parameters / rope_scaling: the numbers parse_rope reads
_ROPE_NUMBERS = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "beta_fast",
                 "beta_slow", "attention_factor", "mscale", "mscale_all_dim",
                 "partial_rotary_factor")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _kind_problem(key: str, v: Any) -> str:
    """What `key` must be, when `v` is not that; '' when it fits (or is null)."""
    if v is None:
        return ""
    if key in _POSITIVE_INTS and not (_is_int(v) and v > 0):
        return "must be a positive integer"
    if key in _INTS and not _is_int(v):
        return "must be an integer"
    if key in _NUMBERS and not _is_number(v):
        return "must be a number"
    if key in _BOOLS and not (isinstance(v, bool) or v in (0, 1)):
        return "must be true or false"
    if key in _MAPPINGS and not isinstance(v, dict):
        return "must be a JSON object or null"
    if key in _STRING_LISTS and not (isinstance(v, list) and all(isinstance(x, str) for x in v)):
        return "must be a list of strings"
    if key == "mlp_only_layers" and not (isinstance(v, list) and all(map(_is_int, v))):
        return "must be a list of layer indices"
    if key == "eos_token_id" and not (_is_int(v) or (isinstance(v, list) and all(map(_is_int, v)))):
        return "must be a token id or a list of them"
    return ""


def check_field_types(cfg: dict[str, Any], source: str) -> None:
    """ModelLoadError naming the first field of config.json (`cfg`) of the wrong type."""
    for key, value in cfg.items():
        if problem := _kind_problem(key, value):
            raise ModelLoadError(f"{source}: {key} {problem}, got {value!r}; fix config.json "
                                 "(or re-download it)")
    for section in ("rope_parameters", "rope_scaling"):
        params = cfg.get(section) or {}
        for key in _ROPE_NUMBERS:
            value = params.get(key)
            if value is not None and not isinstance(value, dict) and not _is_number(value):
                raise ModelLoadError(f"{source}: {section}.{key} must be a number, got "
                                     f"{value!r}; fix config.json (or re-download it)")


def check_generation_config(gen: Any, source: str) -> None:
    """generation_config.json: a JSON object whose eos_token_id (what the worker stops on) is
    an id or a list of ids."""
    if not isinstance(gen, dict):
        raise ModelLoadError(f"{source}: the top level must be a JSON object")
    if problem := _kind_problem("eos_token_id", gen.get("eos_token_id")):
        raise ModelLoadError(f"{source}: eos_token_id {problem}, got "
                             f"{gen['eos_token_id']!r}; fix it (or re-download it)")
