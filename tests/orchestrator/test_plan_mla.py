"""`tandem plan` for a DeepSeek-V3 checkpoint: KV bytes per token per cache group (MLA latent
pages, replicated over TP ranks) and the MLA layout rules, next to a dense K/V model's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.cli import main

# DeepSeek-V3's shapes at 4 layers (config.json as transformers writes it: num_key_value_heads and
# head_dim are there but mean nothing for the cache).
DEEPSEEK = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "num_hidden_layers": 4,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "hidden_size": 7168,
    "head_dim": 64,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "torch_dtype": "bfloat16",
    "vocab_size": 129280,
}
DENSE = {
    "num_hidden_layers": 4,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "hidden_size": 7168,
    "head_dim": 56,
    "torch_dtype": "bfloat16",
    "vocab_size": 129280,
}


def _plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], hf: dict[str, object], *sets: str
) -> tuple[int, list[list[str]], str]:
    """Run `tandem plan` on a checkpoint directory holding `hf` as config.json."""
    (tmp_path / "config.json").write_text(json.dumps(hf))
    args = ["plan", "--config", "configs/tiny-1p1d.yaml", "--set", f"model.path={tmp_path}"]
    for s in sets:
        args += ["--set", s]
    rc = main(args)
    out = capsys.readouterr()
    return rc, [line.split() for line in out.out.splitlines()], out.err


def test_plan_prints_mla_latent_bytes_per_token_per_group(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, lines, _ = _plan(tmp_path, capsys, DEEPSEEK, "roles.decode.parallel.tp_size=2")
    assert rc == 0
    # 4 layers * (512 + 64) latent elements * 2 bytes = 4608 per token per rank, whatever the TP;
    # a TP=2 worker holds two copies.
    assert any(line[:7] == ["prefill", "mla_latent", "4", "4.5", "KiB", "4.5", "KiB"]
               for line in lines), lines
    assert any(line[:7] == ["decode", "mla_latent", "4", "9.0", "KiB", "4.5", "KiB"]
               for line in lines), lines
    # 16-token pages: 73728 bytes per page on one rank (the KV budget row).
    assert any(line[:4] == ["prefill", "1024", "16", "73728"] for line in lines)


def test_dense_twin_prints_full_attention_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, lines, _ = _plan(tmp_path, capsys, DENSE)
    assert rc == 0
    # 4 layers * K,V * 128 heads * 56 dims * 2 bytes: 114688 bytes per token, 24.9x the latent.
    assert any(line[:5] == ["prefill", "full_attention", "4", "112.0", "KiB"] for line in lines)


def test_mla_tp_rules_name_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _plan(
        tmp_path,
        capsys,
        {**DEEPSEEK, "intermediate_size": 18433},
        "roles.prefill.parallel.tp_size=2",
    )
    assert rc == 2
    assert "intermediate_size=18433 must be divisible by tp_size=2" in err
