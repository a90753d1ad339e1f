"""The shape of a worker rank's KV cache, derived once from the model and the config.

Every rank of a worker calls `kv_shape(spec, config)` (rank 0 in the engine, followers in
worker/tp_runner.py), so they allocate identical pools: page ids mean the same memory on every
rank. `max_model_len` is part of that derivation (it decides whether window layers get a ring).
"""

from __future__ import annotations

from transfer.contract import ring_pages
from worker.config import ConfigError, WorkerConfig
from worker.kv_cache import KVShape
from worker.model.base import ModelSpec
from worker.model.fp8 import is_fp8, kv_storage_dtype

# window rings per running seat: decode also holds rings of rooms in flight
WINDOW_RINGS_PER_SEQ = 2
STATE_SLOTS_PER_SEQ = 2  # state slots per running seat, for the same reason


def max_model_len(spec: ModelSpec, config: WorkerConfig) -> int:
    """The context a request may reach: the config's cap, never past the checkpoint's."""
    return config.model.context_len(spec.max_position_embeddings)


def window_layers(spec: ModelSpec, max_len: int) -> tuple[tuple[int, ...], int]:
    """The layers that get a window ring, and their window; ((), 0) = every layer in full pages.

    A ring needs a window shorter than the context and at least one full-attention layer (an
    all-window model would have an empty full page; it keeps masked full pages), and one window
    size for all window layers (one ring geometry per request).
    """
    windows = spec.layer_windows
    layers = tuple(i for i, w in enumerate(windows) if w is not None)
    sizes = {w for w in windows if w is not None}
    if not layers or len(layers) == len(windows) or len(sizes) != 1:
        return (), 0
    (window,) = sizes
    if window >= max_len:
        return (), 0  # the window never slides: plain full pages
    return layers, window


def prefix_cache_enabled(spec: ModelSpec, config: WorkerConfig) -> bool:
    """The config asks for the prefix cache and the model's cached pages are exact for another
    request (not with dynamic NTK RoPE)."""
    return config.cache.enable_prefix_cache and spec.prefix_cache_exact


def state_slots(spec: ModelSpec, config: WorkerConfig) -> tuple[int, int]:
    """(request slots, snapshot slots) of a model with recurrent layers; (0, 0) without."""
    if not spec.state_layers:
        return 0, 0
    seats = config.scheduler.max_num_seqs
    # one snapshot per recent prompt, for prefix-cache hits only
    snapshots = seats if prefix_cache_enabled(spec, config) else 0
    return STATE_SLOTS_PER_SEQ * seats, snapshots


def kv_shape(spec: ModelSpec, config: WorkerConfig, draft_layers: int = 0,
             speculative: str = "") -> KVShape:
    """The KV pool of one rank of this worker (`config.cache.total_pages` pages per DP group).

    `draft_layers`: a model drafter's layers (worker/spec/), appended after the model's own as
    full layers; `speculative` is its label in the layout contract."""
    # With TP > kv heads each rank keeps a replica of one kv head.
    kv_heads = max(1, spec.num_kv_heads // config.parallel.tp_size)
    layers, window = window_layers(spec, max_model_len(spec, config))
    multi_rank = config.parallel.world_size > 1 or config.parallel.nnodes > 1
    if layers and multi_rank:
        raise ConfigError(
            f"parallel: a model with sliding-window layers ({len(layers)} of {spec.num_layers}, "
            f"window {window}) keeps window rings that multi-rank workers do not mirror yet; "
            "run it with parallel.tp_size=1")
    if spec.state_layers and multi_rank:
        raise ConfigError(
            f"parallel: a model with recurrent layers ({len(spec.state_layers)} of "
            f"{spec.num_layers}) keeps state slots that multi-rank workers do not mirror yet; "
            "run it with parallel.tp_size=1 (and dp_size=1)")
    requests, snapshots = state_slots(spec, config)
    rings = ring_pages(window, config.cache.page_size) if layers else 0
    dtype = kv_storage_dtype(config.cache.kv_cache_dtype, spec.dtype)  # the model's, or FP8
    return KVShape(
        num_pages=config.cache.total_pages,
        num_layers=spec.num_layers + draft_layers,
        num_kv_heads=kv_heads,
        page_size=config.cache.page_size,
        head_dim=spec.head_dim,
        dtype=dtype,
        window_layers=layers,
        window=window,
        num_window_pages=rings * WINDOW_RINGS_PER_SEQ * config.scheduler.max_num_seqs,
        latent_dim=spec.kv_latent_dim,  # MLA latent pages (num_kv_heads 1, head_dim the latent)
        state_layers=spec.state_layers,
        state=spec.state_shape,
        num_state_slots=requests + snapshots,
        kv_scales=spec.kv_scales if is_fp8(dtype) else "",
        draft_layers=draft_layers,
        speculative=speculative,
    )
