"""KV bytes per cache group, from a checkpoint's config.json (no torch: the planner's view).

A model's KV memory is one or more cache groups (transfer/contract.py `CacheKind`):
- full_attention: K and V of every token, in pages: bytes per token, over the layers it covers;
- recurrent (Qwen3-Next's Gated DeltaNet, `layer_types` "linear_attention"): a fixed-size state
  per request, whatever its length: the conv state (the last K-1 inputs of q|k|v, model dtype)
  and the delta-rule state (value heads x head_k_dim x head_v_dim, float32), per layer.

The numbers are the whole model's (all TP ranks together), as `tandem plan` prints them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SSM_STATE_BYTES = 4  # the delta-rule state is float32 whatever the model dtype
LINEAR_ATTENTION = "linear_attention"


@dataclass(frozen=True)
class GroupBytes:
    group: str  # "full_attention" | "recurrent"
    num_layers: int
    bytes_per_token: int  # what one more token of context adds (0 for a recurrent group)
    bytes_per_request: int  # fixed per request, whatever its length (0 for a paged group)


def paged_layers(hf: dict[str, Any]) -> int:
    """Layers whose K/V live in pages: all of them but the recurrent ones."""
    return int(hf["num_hidden_layers"]) - len(_linear_layers(hf))


def _linear_layers(hf: dict[str, Any]) -> list[int]:
    return [i for i, t in enumerate(hf.get("layer_types") or []) if t == LINEAR_ATTENTION]


def group_bytes(hf: dict[str, Any], itemsize: int) -> list[GroupBytes]:
    """The model's cache groups and their sizes, for a KV cache of `itemsize`-byte elements."""
    heads = int(hf["num_attention_heads"])
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    head_dim = int(hf.get("head_dim") or hf["hidden_size"] // heads)
    full = paged_layers(hf)
    groups = [GroupBytes("full_attention", full, full * 2 * kv_heads * head_dim * itemsize, 0)]
    linear = _linear_layers(hf)
    if linear:
        nk, nv = int(hf["linear_num_key_heads"]), int(hf["linear_num_value_heads"])
        dk, dv = int(hf["linear_key_head_dim"]), int(hf["linear_value_head_dim"])
        conv_dim = 2 * nk * dk + nv * dv
        conv = (int(hf.get("linear_conv_kernel_dim", 4)) - 1) * conv_dim * itemsize
        ssm = nv * dk * dv * SSM_STATE_BYTES
        groups.append(GroupBytes("recurrent", len(linear), 0, len(linear) * (conv + ssm)))
    return groups
