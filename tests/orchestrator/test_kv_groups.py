"""KV bytes per cache group (orchestrator/kv_groups.py) and `tandem plan`'s table of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.kv_groups import GroupBytes, group_bytes, paged_layers

# Qwen3-Next-80B-A3B's config.json, the keys the planner reads: 48 layers, every 4th full.
QWEN3_NEXT_80B = {
    "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "hidden_size": 2048, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "torch_dtype": "bfloat16",
}
QWEN3_NEXT_80B["layer_types"] = QWEN3_NEXT_80B["layer_types"] * 12  # type: ignore[operator]


def test_qwen3_next_has_a_paged_group_and_a_recurrent_group() -> None:
    full, state = group_bytes(QWEN3_NEXT_80B, itemsize=2)
    assert paged_layers(QWEN3_NEXT_80B) == 12
    # 12 full layers * K,V * 2 kv heads * 256 dims * 2 bytes
    assert full == GroupBytes("full_attention", 12, 12 * 2 * 2 * 256 * 2, 0)
    # per linear layer: conv 3 inputs * (2*16*128 + 32*128) channels * 2 B + ssm 32*128*128 * 4 B
    per_layer = 3 * 8192 * 2 + 32 * 128 * 128 * 4
    assert state == GroupBytes("recurrent", 36, 0, 36 * per_layer)


def test_dense_models_keep_one_group() -> None:
    hf = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
          "hidden_size": 128}
    assert group_bytes(hf, 4) == [GroupBytes("full_attention", 4, 4 * 2 * 2 * 32 * 4, 0)]


def test_plan_prints_bytes_per_group(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hf = {**QWEN3_NEXT_80B, "num_hidden_layers": 4, "intermediate_size": 512,
          "layer_types": QWEN3_NEXT_80B["layer_types"][:4], "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    args = ["plan", "--config", "configs/tiny-1p1d.yaml", "--set", f"model.path={tmp_path}"]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    # 1 full layer * 2 * 2 heads * 16 tokens * 256 dims * 4 B per page (recurrent layers: no pages)
    assert any(line.split()[:4] == ["decode", "1024", "16", "65536"] for line in lines)
    assert any(line.split() == ["full_attention", "1", "4.0", "KiB", "-"] for line in lines)
    per_layer = 3 * 8192 * 4 + 32 * 128 * 128 * 4
    mib = f"{3 * per_layer / 2**20:.1f}"
    assert any(line.split() == ["recurrent", "3", "-", mib, "MiB"] for line in lines), lines
