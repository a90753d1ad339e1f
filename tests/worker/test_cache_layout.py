"""The cache's shape from the model and the config (worker/cache_layout.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from worker.cache_layout import STATE_SLOTS_PER_SEQ, prefix_cache_enabled, state_slots
from worker.config import CacheConfig, SchedulerConfig, WorkerConfig
from worker.model.base import ModelSpec

_RECURRENT = ModelSpec(
    architecture="Qwen3NextForCausalLM", num_layers=4, hidden_size=64, num_heads=4,
    num_kv_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=512,
    eos_token_ids=(0,), dtype=torch.float32, fingerprint="dummy:0", sliding_window=None,
    state_layers=(0, 1, 2),
)


@pytest.mark.parametrize(("exact", "enabled", "snapshots"),
                         [(True, True, 8), (True, False, 0), (False, True, 0)])
def test_state_snapshots_only_where_the_prefix_cache_runs(
        exact: bool, enabled: bool, snapshots: int) -> None:
    """A state snapshot serves a prefix-cache hit only; a model whose cached pages are not
    exact (dynamic NTK RoPE) runs without the cache, so it keeps no snapshot slots either."""
    spec = dataclasses.replace(_RECURRENT, prefix_cache_exact=exact)
    config = WorkerConfig(cache=CacheConfig(enable_prefix_cache=enabled),
                          scheduler=SchedulerConfig(max_num_seqs=8))
    assert prefix_cache_enabled(spec, config) is (exact and enabled)
    assert state_slots(spec, config) == (STATE_SLOTS_PER_SEQ * 8, snapshots)
