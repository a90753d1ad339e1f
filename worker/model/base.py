"""The model-side contract the engine relies on: `ModelSpec` and the `CausalLM` interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from worker.batch import ForwardBatch
from worker.kv_cache import KVCache, StateShape


@dataclass(frozen=True)
class ModelSpec:
    """What the engine and the transfer layout contract need to know, from config.json."""

    architecture: str  # e.g. "Qwen3ForCausalLM"
    num_layers: int
    hidden_size: int
    num_heads: int  # attention heads in the whole model (divide by tp_size for one rank)
    num_kv_heads: int  # KV heads in the whole model
    head_dim: int
    vocab_size: int
    # the longest context the checkpoint serves: config.json's max_position_embeddings,
    # extended by its RoPE scaling (worker/arch/hf_config.py scaled_context)
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]  # generation_config.json's, then config.json's (deduplicated)
    # the dtype the weights compute in (the KV cache's too unless kv_cache_dtype is set)
    dtype: torch.dtype
    fingerprint: str  # sha256 over config.json and the safetensors headers; "dummy:<seed>"
    sliding_window: int | None  # largest window of any sliding layer; None = all full attention
    layer_windows: tuple[
        int | None, ...
    ] = ()  # per layer: its sliding window, None = full attention
    # Recurrent layers (a fixed-size state slot per request, no K/V pages), ascending, and one
    # slot of one such layer on one rank (CausalLM.state_shape); () / None without any.
    state_layers: tuple[int, ...] = ()
    state_shape: StateShape | None = None
    # MLA (DeepSeek): the KV cache keeps one latent row of this width per token per layer (no heads,
    # no K/V pair; num_kv_heads is then 1 and head_dim this width). 0 = K/V heads.
    kv_latent_dim: int = 0
    # The checkpoint's K/V cache scales for FP8 pages (worker/model/fp8.py KVScales.label): "1.0"
    # when it has none, else "checkpoint per-tensor|per-head sha256:…".
    kv_scales: str = "1.0"
    # Whether a page of keys computed for one request is valid for another that shares its
    # tokens. False for dynamic NTK RoPE, whose rotation depends on the whole request's length
    # (worker/model/rope.py): such a model runs without the prefix cache.
    prefix_cache_exact: bool = True


@dataclass(frozen=True)
class WeightSlot:
    """Where one checkpoint tensor goes: a module with `load(param, source, shard_id)`."""

    module: nn.Module
    param: str  # "weight" or "bias"
    shard_id: object = None  # which piece of a fused parameter ("q"/"k"/"v", 0/1); None = whole


class CausalLM(nn.Module, ABC):
    """A decoder-only LM over the paged KV cache."""

    @abstractmethod
    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Run this step's tokens; write their K/V at slot_mapping. Returns hidden [T, hidden]."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (the rows the engine samples from) → logits [N, vocab] float32."""

    @abstractmethod
    def weight_slots(self) -> dict[str, WeightSlot]:
        """Checkpoint tensor name → where it loads. The loader requires every name listed."""

    def set_fused_kernels(self, enabled: bool) -> None:
        """Switch to the model's CUDA kernels (the loader's choice on CUDA); none by default."""

    def state_layers(self) -> tuple[int, ...]:
        """Layers that keep a recurrent state slot instead of K/V pages (none by default)."""
        return ()

    def state_shape(self) -> StateShape | None:
        """One state slot of one recurrent layer on this rank: conv and ssm shapes and dtypes
        (KVCache.state's views). None for attention-only models."""
        return None

    def commit_verified(self, kv: KVCache, accepted: dict[int, int]) -> None:
        """After a verify step (ForwardBatch.verify_requests): state slot -> index of the last
        accepted token of its chunk. A model with recurrent layers keeps the state after that
        token (the forward left the state after every draft); others have nothing to do."""

    @property
    def supports_cuda_graphs(self) -> bool:
        """Whether a decode step can be captured once and replayed (no per-step host logic)."""
        return True

    def drop_unloaded(self, loaded: set[str]) -> None:
        """After a checkpoint load, with the names it filled: let go of optional modules the
        checkpoint did not carry (DeepSeek's MTP layers), so that `weight_slots` lists only what
        must be there. Most models have none."""
