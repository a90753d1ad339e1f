"""A checkpoint directory's config.json (and generation_config.json) as the worker will read
it: `load_arch_config` picks the family's parser and returns its ArchConfig, or raises
ModelLoadError with one line naming the file and field. No torch: the launcher and `tandem
plan` run it before any worker starts."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tokenizers

from worker.arch.deepseek_config import parse_deepseek_v3
from worker.arch.field_types import check_field_types, check_generation_config
from worker.arch.gpt_oss_config import gpt_oss_layer_windows, parse_gpt_oss_config
from worker.arch.hf_config import (
    SUPPORTED_ARCHITECTURES,
    ArchConfig,
    ModelLoadError,
    layer_windows,
    parse_arch_config,
)
from worker.arch.hf_defaults import with_absent_defaults
from worker.arch.qwen3_next_config import parse_qwen3_next_config

# Families with fields of their own parse config.json themselves (the rest: parse_arch_config).
_CONFIG_PARSERS: dict[str, Callable[..., ArchConfig]] = {
    "GptOssForCausalLM": parse_gpt_oss_config,
    "Qwen3NextForCausalLM": parse_qwen3_next_config,
    "DeepseekV3ForCausalLM": parse_deepseek_v3,
}


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(
            f"{path} does not exist; model.path must be an HF-format directory"
        ) from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None


# safetensors header dtype names of the floating dtypes a checkpoint is served in
_SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def config_dtype(cfg: dict[str, Any], path: Path) -> str | None:
    """The dtype config.json declares, as transformers reads it: `dtype`, else `torch_dtype`;
    neither (an older or hand-written config), the floating dtype most of the checkpoint's
    safetensors hold (transformers and vLLM fall back to the weights too). None when there is
    nothing to read (a shape-only directory)."""
    named = cfg.get("dtype") or cfg.get("torch_dtype")
    if named and str(named).replace("torch.", "").startswith("float8") and cfg.get(
        "quantization_config"
    ):
        # an FP8 checkpoint naming its linears' storage dtype: its other tensors, and the
        # compute, are bfloat16 (the FP8 linears are scaled into it)
        return "bfloat16"
    if named:
        return str(named)
    counts: dict[str, int] = {}
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            raw = fh.read(8)
            n = int.from_bytes(raw, "little") if len(raw) == 8 else 0
            try:
                header = json.loads(fh.read(n)) if 0 < n <= 100 << 20 else {}
            except (json.JSONDecodeError, UnicodeDecodeError):
                header = {}  # the checkpoint checks name a broken file; nothing to read here
        entries = header.values() if isinstance(header, dict) else ()
        for entry in (e for e in entries if isinstance(e, dict)):  # __metadata__: no dtype
            name = _SAFETENSORS_DTYPES.get(str(entry.get("dtype")))
            if name:
                counts[name] = counts.get(name, 0) + 1
    return max(counts, key=lambda k: counts[k]) if counts else None


def load_arch_config(path: Path) -> ArchConfig:
    if not path.is_dir():
        raise ModelLoadError(
            f"model.path {str(path)!r} is not a directory; point it at an HF checkpoint directory"
        )
    gen_path = path / "generation_config.json"
    gen = read_json(gen_path) if gen_path.exists() else None
    if gen is not None:
        check_generation_config(gen, str(gen_path))
    cfg = read_json(path / "config.json")
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{path / 'config.json'}: the top level must be a JSON object")
    check_field_types(cfg, str(path / "config.json"))  # before any parser's int() or bool()
    # an absent field means what transformers means by it
    cfg = with_absent_defaults(cfg, has_generation_config=gen is not None)
    dtype = config_dtype(cfg, path)
    if dtype and dtype != (cfg.get("dtype") or cfg.get("torch_dtype")):
        cfg = {**cfg, "dtype": dtype}  # what the weights hold: the parsers read `dtype`
    archs = cfg.get("architectures") or []
    parse = next((_CONFIG_PARSERS[a] for a in archs if a in _CONFIG_PARSERS), parse_arch_config)
    arch = parse(cfg, gen, source=str(path / "config.json"))
    eos = tokenizer_eos_id(path)
    if eos is None or eos in arch.eos_token_ids:
        return arch
    return dataclasses.replace(arch, eos_token_ids=(*arch.eos_token_ids, eos))


def tokenizer_eos_id(path: Path) -> int | None:
    """The id of tokenizer_config.json's eos_token in tokenizer.json: a stop token beside
    generation_config.json's, as vLLM and SGLang stop on it (a ChatML fine-tune of a Llama base
    says `<|im_end|>` there and keeps config.json's `</s>`). None where either file or the
    token is missing."""
    cfg_path, tok_path = path / "tokenizer_config.json", path / "tokenizer.json"
    if not (cfg_path.is_file() and tok_path.is_file()):
        return None
    cfg = read_json(cfg_path)
    eos = cfg.get("eos_token") if isinstance(cfg, dict) else None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if not isinstance(eos, str):
        return None
    try:  # the tokenizers library's own lookup: added tokens and every model type's vocab
        tid = tokenizers.Tokenizer.from_file(str(tok_path)).token_to_id(eos)
    except Exception:  # noqa: BLE001 (an unreadable tokenizer.json: the gateway names it)
        return None
    return None if tid is None else int(tid)


def config_layer_windows(cfg: dict[str, Any],
                         source: str = "config.json") -> tuple[int | None, ...]:
    """Per layer of a config.json: its sliding window in tokens, None = full attention (or a
    recurrent layer), by the family's rule as the worker's parser applies it."""
    n = int(cfg["num_hidden_layers"])
    archs = cfg.get("architectures") or []
    if "GptOssForCausalLM" in archs:
        return gpt_oss_layer_windows(cfg, n, source)
    return layer_windows(cfg, next((a for a in archs if a in SUPPORTED_ARCHITECTURES), ""), n,
                         source)
