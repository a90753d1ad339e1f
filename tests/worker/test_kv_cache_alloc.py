"""A KV pool that does not fit the device is a config error naming the setting to lower, not
the allocator's traceback (`tandem worker` started by hand, past serve's memory preflight)."""

from __future__ import annotations

import pytest
import torch

from worker.config import ConfigError
from worker.kv_cache import KVCache, KVShape


def test_a_pool_past_the_devices_memory_names_the_setting() -> None:
    shape = KVShape(num_pages=2**40, num_layers=2, num_kv_heads=2, page_size=16, head_dim=64,
                    dtype=torch.float16)
    with pytest.raises(ConfigError, match=r"do not fit on cpu .*lower cache.num_pages or "
                                          r"cache.max_total_tokens"):
        KVCache(shape)
    small = KVCache(KVShape(num_pages=4, num_layers=2, num_kv_heads=2, page_size=16, head_dim=64,
                            dtype=torch.float16))
    assert small.data.shape == (4, 2, 2, 2, 16, 64)
