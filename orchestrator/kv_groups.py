"""KV cache groups of a checkpoint, from its config.json alone (no torch: `tandem plan` runs
anywhere), and what each costs per token.

A worker keeps each group in its own region (worker/kv_cache.py, docs/hybrid-cache.md):

- `full_attention`: every token of the context, in pages;
- `sliding_window`: only the last W tokens, in a ring of ceil(W / page_size) + 1 pages per
  request — when the model mixes window and full layers with one window shorter than its
  context (the engine's `window_layers` rule). Otherwise window layers stay in full pages.

Which layers slide follows transformers per family: `layer_types` with `sliding_window`
(GPT-OSS, Gemma-2 style; GPT-OSS defaults to even layers sliding when `layer_types` is absent),
Qwen2/3's `use_sliding_window` + `max_window_layers`, else every layer when `sliding_window` is
set (Mistral).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FULL, WINDOW = "full_attention", "sliding_window"


@dataclass(frozen=True)
class KVGroup:
    """One cache group of one role's workers (per replica, all TP ranks together)."""

    kind: str  # full_attention | sliding_window
    layers: tuple[int, ...]
    bytes_per_token: int  # K and V of the group's layers for one token
    window: int = 0  # sliding_window: tokens a request keeps; 0 = every token

    def ring_pages(self, page_size: int) -> int:
        return -(-self.window // page_size) + 1 if self.window else 0


def layer_windows(hf: dict[str, Any]) -> list[int | None]:
    """Per layer: its sliding window in tokens, None = full attention."""
    n = int(hf["num_hidden_layers"])
    model_type = str(hf.get("model_type", ""))
    window = hf.get("sliding_window")
    if model_type.startswith("qwen") and not hf.get("use_sliding_window", False):
        window = None  # Qwen configs carry a window that is off unless use_sliding_window
    if window is None:
        return [None] * n
    types = hf.get("layer_types")
    if not types and model_type == "gpt_oss":
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    if types:
        return [int(window) if t == "sliding_attention" else None for t in types]
    if model_type in ("qwen2", "qwen3"):
        first = int(hf.get("max_window_layers", n))
        return [int(window) if i >= first else None for i in range(n)]
    return [int(window)] * n


def kv_groups(
    hf: dict[str, Any], dtype_bytes: int, tp_size: int, max_model_len: int
) -> list[KVGroup]:
    """The groups a worker with `tp_size` ranks keeps for this checkpoint (see module doc)."""
    heads = int(hf["num_attention_heads"])
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // heads)
    # With TP > kv heads each rank keeps a replica of one head: the replica's bytes grow.
    per_layer = 2 * max(1, kv_heads // tp_size) * tp_size * head_dim * dtype_bytes
    windows = layer_windows(hf)
    slid = tuple(i for i, w in enumerate(windows) if w is not None)
    sizes = {w for w in windows if w is not None}
    ring = (
        bool(slid) and len(slid) < len(windows) and len(sizes) == 1 and min(sizes) < max_model_len
    )
    if not ring:
        return [KVGroup(FULL, tuple(range(len(windows))), len(windows) * per_layer)]
    full = tuple(i for i in range(len(windows)) if i not in slid)
    return [
        KVGroup(FULL, full, len(full) * per_layer),
        KVGroup(WINDOW, slid, len(slid) * per_layer, window=sizes.pop()),
    ]
