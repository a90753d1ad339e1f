"""KV cache groups in the planner (orchestrator/kv_groups.py): which layers keep a window ring
or a recurrent state, bytes per token (and per request) per group, and `tandem plan`'s KV budget
equal to what a worker allocates."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from orchestrator.cli import main
from orchestrator.config import config_from_dict, load_config
from orchestrator.kv_groups import FULL, RECURRENT, WINDOW, KVGroup, kv_groups
from orchestrator.plan import LayoutError, check_layout, kv_budget, read_model_config
from orchestrator.plan_text import format_plan
from orchestrator.worker_config import worker_config
from worker.arch.load import config_layer_windows

# openai/gpt-oss-120b's shapes (only the keys the planner reads).
GPT_OSS_120B = {
    "architectures": ["GptOssForCausalLM"],
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
    """The planner's groups follow the worker's rule (worker/arch), per architecture."""
    gpt_oss = {k: v for k, v in GPT_OSS_120B.items() if k != "layer_types"}
    assert config_layer_windows(gpt_oss)[:3] == (128, None, 128)  # transformers' alternation
    qwen: dict[str, Any] = {"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 4,
                            "sliding_window": 8}
    assert config_layer_windows(qwen) == (None,) * 4  # off unless use_sliding_window
    on = {**qwen, "use_sliding_window": True, "max_window_layers": 1}
    assert config_layer_windows(on) == (None, 8, 8, 8)
    mistral = {"architectures": ["MistralForCausalLM"], "num_hidden_layers": 2,
               "sliding_window": 8}
    assert config_layer_windows(mistral) == (8, 8)
    # transformers' Llama reads no sliding_window: a stray one must not shrink the plan's KV
    llama = {**mistral, "architectures": ["LlamaForCausalLM"], "num_attention_heads": 4,
             "hidden_size": 64, "layer_types": ["sliding_attention", "full_attention"]}
    assert config_layer_windows(llama) == (None, None)
    assert [g.kind for g in kv_groups(llama, 2, 1, 4096)] == [FULL]


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
    assert any(line.split()[1:] == ["sliding_window", "2", "512", "B", "512", "B", "-", "last",
                                    "8", "tokens", "(ring", "of", "2", "pages)"]
               for line in text.splitlines()), text
    for budget in kv_budget(cluster, read_model_config(cluster.model.path)):
        engine = Engine(worker_config(cluster, budget.role, 0))
        assert budget.total_bytes == engine.kv.nbytes(), budget.role
        assert budget.page_bytes == engine.kv.shape.page_bytes


@pytest.mark.parametrize(("method", "drafts"), [("eagle", 1), ("mtp", 1), ("draft", 2)])
def test_plan_counts_a_drafters_kv_layers_as_the_worker_allocates(method: str,
                                                                  drafts: int) -> None:
    """A model drafter keeps its K/V in the target's pages (the embedded model ships all three
    drafters: eagle and mtp one layer each, the draft model two)."""
    from worker.engine import Engine

    cluster = load_config("configs/tiny-1p1d.yaml", [f"speculative.method={method}"])
    text = format_plan(cluster)
    assert f"full_attention  4 + {drafts} {method}" in text, text
    budget = kv_budget(cluster, read_model_config(cluster.model.path))[1]
    (group,) = budget.groups
    assert (len(group.layers), group.draft_layers) == (4 + drafts, drafts)
    engine = Engine(worker_config(cluster, budget.role, 0))
    assert budget.page_bytes == engine.kv.shape.page_bytes
    assert budget.total_bytes == engine.kv.nbytes()


# Qwen3-Next-80B-A3B's config.json, the keys the planner reads: 48 layers, every 4th full.
QWEN3_NEXT_80B = {
    "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "hidden_size": 2048, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "torch_dtype": "bfloat16",
}
QWEN3_NEXT_80B["layer_types"] = QWEN3_NEXT_80B["layer_types"] * 12  # type: ignore[operator]


def test_qwen3_next_has_a_paged_group_and_a_recurrent_group() -> None:
    full, state = kv_groups(QWEN3_NEXT_80B, dtype_bytes=2)
    # 12 full layers * K,V * 2 kv heads * 256 dims * 2 bytes
    assert full == KVGroup(FULL, tuple(range(3, 48, 4)), 12 * 2 * 2 * 256 * 2)
    # per linear layer: conv 3 inputs * (2*16*128 + 32*128) channels * 2 B + ssm 32*128*128 * 4 B
    per_layer = 3 * 8192 * 2 + 32 * 128 * 128 * 4
    assert state.kind == RECURRENT and len(state.layers) == 36
    assert state.bytes_per_request == 36 * per_layer and state.bytes_per_token == 0


def test_dense_models_keep_one_group() -> None:
    hf = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
          "hidden_size": 128}
    assert kv_groups(hf, 4) == [KVGroup(FULL, (0, 1, 2, 3), 4 * 2 * 2 * 32 * 4)]


def test_plan_prints_bytes_per_group(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hf = {**QWEN3_NEXT_80B, "num_hidden_layers": 4, "intermediate_size": 512,
          "layer_types": QWEN3_NEXT_80B["layer_types"][:4], "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    args = ["plan", "--config", "configs/tiny-1p1d.yaml", "--set", f"model.path={tmp_path}"]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    # 1 full layer * 2 * 2 heads * 16 tokens * 256 dims * 4 B per page (recurrent layers: no pages)
    assert any(line.split()[:4] == ["decode", "1024", "16", "65536"] for line in lines)
    assert any(line.split()[:5] == ["decode", "full_attention", "1", "4.0", "KiB"]
               for line in lines), lines
    per_layer = 3 * 8192 * 4 + 32 * 128 * 128 * 4
    mib = f"{3 * per_layer / 2**20:.1f}"
    assert any(line.split()[:7] == ["decode", "recurrent", "3", "-", "-", mib, "MiB"]
               for line in lines), lines
