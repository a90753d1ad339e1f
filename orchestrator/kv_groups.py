"""KV cache groups of a checkpoint, from its config.json alone (no torch: `tandem plan` runs
anywhere), and what each costs.

A worker keeps each group in its own region (worker/kv_cache.py, docs/hybrid-cache.md,
docs/recurrent-state.md):

- `full_attention`: K and V of every token of the context, in pages: bytes per token;
- `sliding_window`: only the last W tokens, in a ring of ceil(W / page_size) + 1 pages per
  request — when the model mixes window and full layers with one window shorter than its
  context (the engine's `window_layers` rule). Otherwise window layers stay in full pages;
- `mla_latent` (DeepSeek's MLA): one latent row per token per layer (kv_lora_rank +
  qk_rope_head_dim elements), in pages, the same on every TP rank (each rank keeps it whole);
- `recurrent` (Qwen3-Next's Gated DeltaNet, `layer_types` "linear_attention"): a fixed-size
  state per request whatever its length: the conv state (the last K-1 inputs of q|k|v, model
  dtype) and the delta-rule state (value heads x head_k_dim x head_v_dim, float32), per layer.

A model drafter (`speculative.method` draft, eagle or mtp, worker/spec/) keeps its own K/V in
the paged group's pages, as layers after the model's own (`draft_layers`): one for eagle and
mtp, the draft model's `num_hidden_layers` for draft (its KV geometry is the target's).

Which layers slide is the worker's own rule (worker/arch `config_layer_windows`, transformers'
per family). Figures are per replica, all TP ranks together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from worker.arch.load import config_layer_windows

FULL, WINDOW, RECURRENT, MLA = "full_attention", "sliding_window", "recurrent", "mla_latent"
LINEAR_ATTENTION = "linear_attention"  # layer_types entry of a recurrent layer
SSM_STATE_BYTES = 4  # the delta-rule state is float32 whatever the model dtype


@dataclass(frozen=True)
class KVGroup:
    """One cache group of one role's workers (per replica, all TP ranks together)."""

    kind: str  # full_attention | sliding_window | recurrent
    layers: tuple[int, ...]
    bytes_per_token: int  # what one more token of context adds (0 for a recurrent group)
    window: int = 0  # sliding_window: tokens a request keeps; 0 = every token
    bytes_per_request: int = 0  # recurrent: fixed per request, whatever its length
    draft_layers: int = 0  # of `layers`, the drafter's (the last ones; full or MLA group)

    def ring_pages(self, page_size: int) -> int:
        return -(-self.window // page_size) + 1 if self.window else 0


def mla_latent_dim(hf: dict[str, Any]) -> int:
    """DeepSeek MLA: the KV cache keeps kv_lora_rank + qk_rope_head_dim elements per token per
    layer (one latent, no heads, the same on every TP rank); 0 for K/V models."""
    if not hf.get("kv_lora_rank"):
        return 0
    return int(hf["kv_lora_rank"]) + int(hf.get("qk_rope_head_dim") or 0)


def linear_layers(hf: dict[str, Any]) -> tuple[int, ...]:
    return tuple(i for i, t in enumerate(hf.get("layer_types") or []) if t == LINEAR_ATTENTION)


def paged_layers(hf: dict[str, Any]) -> int:
    """Layers whose K/V live in pages (full or window): all of them but the recurrent ones."""
    return int(hf["num_hidden_layers"]) - len(linear_layers(hf))


def _recurrent(hf: dict[str, Any], layers: tuple[int, ...], dtype_bytes: int) -> KVGroup:
    nk, nv = int(hf["linear_num_key_heads"]), int(hf["linear_num_value_heads"])
    dk, dv = int(hf["linear_key_head_dim"]), int(hf["linear_value_head_dim"])
    conv_dim = 2 * nk * dk + nv * dv
    conv = (int(hf.get("linear_conv_kernel_dim", 4)) - 1) * conv_dim * dtype_bytes
    ssm = nv * dk * dv * SSM_STATE_BYTES
    return KVGroup(RECURRENT, layers, 0, bytes_per_request=len(layers) * (conv + ssm))


def kv_groups(
    hf: dict[str, Any], dtype_bytes: int, tp_size: int = 1, max_model_len: int = 1 << 62,
    state_dtype_bytes: int = 0, draft_layers: int = 0,
) -> list[KVGroup]:
    """The groups a worker with `tp_size` ranks keeps for this checkpoint (see module doc), for
    KV pages of `dtype_bytes`-byte elements (a recurrent conv state: `state_dtype_bytes`, the
    model dtype's, default the same), with a drafter's `draft_layers` in the paged group."""
    n = int(hf["num_hidden_layers"])
    drafts = tuple(range(n, n + draft_layers))
    latent = mla_latent_dim(hf)
    if latent:  # every rank keeps each page whole: the replica holds tp_size copies
        layers = (*range(n), *drafts)
        return [KVGroup(MLA, layers, len(layers) * latent * dtype_bytes * tp_size,
                        draft_layers=draft_layers)]
    heads = int(hf["num_attention_heads"])
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // heads)
    # With TP > kv heads each rank keeps a replica of one head: the replica's bytes grow.
    per_layer = 2 * max(1, kv_heads // tp_size) * tp_size * head_dim * dtype_bytes
    linear = linear_layers(hf)
    tail = [_recurrent(hf, linear, state_dtype_bytes or dtype_bytes)] if linear else []
    windows = [w for i, w in enumerate(config_layer_windows(hf)) if i not in linear]
    attention = [i for i in range(n) if i not in linear]
    slid = tuple(i for i, w in zip(attention, windows, strict=True) if w is not None)
    sizes = {w for w in windows if w is not None}
    ring = bool(slid) and len(slid) < len(attention) and len(sizes) == 1
    if not ring or min(sizes) >= max_model_len:
        paged = (*attention, *drafts)
        return [KVGroup(FULL, paged, len(paged) * per_layer, draft_layers=draft_layers), *tail]
    full = (*(i for i in attention if i not in slid), *drafts)
    return [
        KVGroup(FULL, full, len(full) * per_layer, draft_layers=draft_layers),
        KVGroup(WINDOW, slid, len(slid) * per_layer, window=sizes.pop()),
        *tail,
    ]
