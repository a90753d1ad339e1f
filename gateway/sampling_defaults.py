"""A model's sampling defaults: what its generation_config.json says, for the fields a request
leaves out (`gateway.generation_config: auto`, as vLLM's default `--generation-config auto`).

Model makers ship their recommended sampling there (Qwen3: temperature 0.6, top_p 0.95,
top_k 20). A request's own field always wins; a field it leaves out (or sends as null) takes
the file's value, else the API's default (temperature 1, top_p 1, top_k off, min_p 0,
repetition_penalty 1). `none` keeps the API's defaults whatever the file says. The values are
checked when the gateway starts, by the rules a request's own values meet.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from gateway.config import GatewayConfigError

# The fields read (generation_config.json's names are the request's), each with its rule.
_RULES: dict[str, tuple[str, Any]] = {
    "temperature": (">= 0", lambda v: v >= 0),
    "top_p": ("in (0, 1]", lambda v: 0 < v <= 1),
    "top_k": ("-1 (off) or >= 0", lambda v: v == int(v) and v >= -1),
    "min_p": ("in [0, 1]", lambda v: 0 <= v <= 1),
    "repetition_penalty": ("> 0", lambda v: v > 0),
}


def load_sampling_defaults(model_path: str, mode: str) -> dict[str, float]:
    """{field: value} from `model_path`/generation_config.json (mode "auto"), else {}."""
    file = Path(model_path) / "generation_config.json" if model_path else None
    if mode != "auto" or file is None or not file.is_file():
        return {}
    try:
        cfg = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GatewayConfigError(f"{file}: unreadable ({exc}); fix it, or set "
                                 "gateway.generation_config: none to ignore it") from exc
    out: dict[str, float] = {}
    for name, (rule, ok) in _RULES.items():
        value = cfg.get(name) if isinstance(cfg, dict) else None
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or not ok(value):
            raise GatewayConfigError(f"{file}: {name} must be a number {rule}, got {value!r}; "
                                     "fix it, or set gateway.generation_config: none")
        out[name] = value
    return out


def describe(defaults: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in defaults.items()) or "none in the file"
