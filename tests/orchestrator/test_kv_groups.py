"""KV cache groups in the planner (orchestrator/kv_groups.py): which layers keep a window ring,
bytes per token per group, and `tandem plan`'s KV budget equal to what a worker allocates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from orchestrator.config import config_from_dict, load_config, worker_config
from orchestrator.kv_groups import FULL, WINDOW, kv_groups, layer_windows
from orchestrator.plan import LayoutError, check_layout, format_plan, kv_budget, read_model_config

# openai/gpt-oss-120b's shapes (only the keys the planner reads).
GPT_OSS_120B = {
    "model_type": "gpt_oss",
    "num_hidden_layers": 36,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_local_experts": 128,
    "sliding_window": 128,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
    "layer_types": ["sliding_attention", "full_attention"] * 18,
}


def test_gpt_oss_has_a_full_and_a_window_group() -> None:
    full, window = kv_groups(GPT_OSS_120B, dtype_bytes=2, tp_size=1, max_model_len=131072)
    assert (full.kind, window.kind) == (FULL, WINDOW)
    assert full.layers == tuple(range(1, 36, 2)) and window.layers == tuple(range(0, 36, 2))
    assert (
        full.bytes_per_token == window.bytes_per_token == 18 * 2 * 8 * 64 * 2
    )  # 36 KiB per token each
    assert window.window == 128 and window.ring_pages(16) == 9
    # TP 16 > 8 kv heads: every rank keeps a replica, the replica's bytes double.
    assert kv_groups(GPT_OSS_120B, 2, 16, 131072)[0].bytes_per_token == 2 * full.bytes_per_token
    # A window as long as the context never slides: one group of full pages.
    assert [g.kind for g in kv_groups(GPT_OSS_120B, 2, 1, 128)] == [FULL]


def test_layer_windows_follow_each_family() -> None:
    gpt_oss = {k: v for k, v in GPT_OSS_120B.items() if k != "layer_types"}
    assert layer_windows(gpt_oss)[:3] == [128, None, 128]  # transformers' default alternation
    qwen: dict[str, Any] = {"model_type": "qwen2", "num_hidden_layers": 4, "sliding_window": 8}
    assert layer_windows(qwen) == [None] * 4  # off unless use_sliding_window
    assert layer_windows({**qwen, "use_sliding_window": True, "max_window_layers": 1}) == [
        None,
        8,
        8,
        8,
    ]
    assert layer_windows(
        {"model_type": "mistral", "num_hidden_layers": 2, "sliding_window": 8}
    ) == [8, 8]


def test_gpt_oss_expert_width_is_checked_under_moe_tp() -> None:
    c = config_from_dict(
        {
            "roles": {
                "prefill": {"base_port": 30000, "parallel": {"tp_size": 3}},
                "decode": {"base_port": 31000},
            },
            "scheduler": {"max_num_seqs": 8, "chunked_prefill_size": 512},
        }
    )
    hf = {
        **GPT_OSS_120B,
        "num_attention_heads": 6,
        "num_key_value_heads": 3,
        "intermediate_size": 32,
    }
    with pytest.raises(LayoutError, match="moe_intermediate_size=32 must be divisible"):
        check_layout(c, hf)


@pytest.mark.slow
def test_plan_budget_equals_the_workers_allocation(tmp_path: Path) -> None:
    from tests.worker.gpt_oss_model import build_gpt_oss_checkpoint
    from worker.engine import Engine

    build_gpt_oss_checkpoint(tmp_path / "gpt-oss")
    cluster = load_config(
        "configs/tiny-1p1d.yaml", [f"model.path={tmp_path / 'gpt-oss'}", "model.dtype=float32"]
    )
    text = format_plan(cluster)
    assert "sliding_window  2       512          last 8 tokens (ring of 2 pages)" in text
    for budget in kv_budget(cluster, read_model_config(cluster.model.path)):
        engine = Engine(worker_config(cluster, budget.role, 0))
        assert budget.total_bytes == engine.kv.nbytes(), budget.role
        assert budget.page_bytes == engine.kv.shape.page_bytes
