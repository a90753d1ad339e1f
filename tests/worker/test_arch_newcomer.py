"""Checkpoints a newcomer writes with transformers and serves as they are: what a tiny random
model of each family, saved by `save_pretrained` (then trimmed or edited as real configs are),
must serve like transformers does, or refuse in one line naming the field.

Regressions found by that pass:

- a DeepSeek-V3 config.json without `n_group` / `topk_group`: transformers' DeepseekV3Config
  routes through 8 groups keeping the best 4; ours read an absent n_group as 1 and an absent
  topk_group as n_group (no group restriction at all), so routed experts differed silently;
- `rope_scaling` added by hand (as model cards say, for long context) to a config.json that
  transformers 5 wrote with `rope_parameters`: transformers reads rope_scaling alone, ours read
  rope_parameters alone (logits off by ~9); both given and meaning different things is now
  refused in one line naming both (transformers also drops rope_parameters' rope_theta then);
- a GPT-OSS RoPE dict without rope_theta (and none at the top level): transformers' class
  default is 150000, ours read 10000 (logits off by ~6);
- a head_dim that is not a power of two of at least 16 (80, 96, 100: some Llama / Mistral
  checkpoints; 8 or 4: tiny test models) loads on the CPU, where it serves like transformers,
  but CUDA's Triton attention kernels cannot compile it (`arange's range must be a power of 2`,
  `K >= 16` for a 16-bit dot, checked by compiling them for sm_90): a traceback at the first
  step, now a one-line refusal at load naming head_dim.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.worker.deepseek_model import build_deepseek_checkpoint
from tests.worker.gpt_oss_model import build_gpt_oss_checkpoint
from tests.worker.test_arch_variants import LLAMA_CFG, build, engine_vs_transformers
from worker.arch.hf_config import ModelLoadError, parse_arch_config
from worker.arch.load import load_arch_config
from worker.arch.qwen3_next_config import parse_qwen3_next_config
from worker.model import loader


def _edit_config(path: Path, drop: tuple[str, ...] = (), **fields: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for key in drop:
        cfg.pop(key, None)
    cfg.update(fields)
    (path / "config.json").write_text(json.dumps(cfg))


def test_deepseek_without_group_fields_routes_like_transformers(tmp_path: Path) -> None:
    """16 experts in 8 groups of 2, the best 4 groups kept (transformers' defaults): served
    without the restriction, the picked experts (and the logits) differed."""
    build_deepseek_checkpoint(tmp_path, n_routed_experts=16, n_group=8, topk_group=4,
                              num_experts_per_tok=4, tokenizer=False)
    _edit_config(tmp_path, drop=("n_group", "topk_group"))
    family = load_arch_config(tmp_path).family
    assert (family.n_group, family.topk_group) == (8, 4)
    ours, theirs, worst = engine_vs_transformers(tmp_path, lens=(5, 23, 41), new=6)
    assert worst < 1e-4, f"max |logit diff| {worst}"
    assert ours == theirs
    # n_group given, topk_group absent: transformers keeps 4 groups, not n_group of them
    _edit_config(tmp_path, n_group=4)
    assert load_arch_config(tmp_path).family.topk_group == 4



LINEAR = {"type": "linear", "factor": 4.0}


def test_rope_scaling_beside_rope_parameters_is_refused_when_they_disagree(
        tmp_path: Path) -> None:
    path = build(tmp_path, "llama", {}, edit={"rope_scaling": LINEAR})  # rope_parameters: default
    with pytest.raises(ModelLoadError, match="rope_scaling .* and rope_parameters .* disagree") \
            as exc:
        load_arch_config(path)
    assert "\n" not in str(exc.value)
    for parse, extra in ((parse_arch_config, {}), (parse_qwen3_next_config, {
            "architectures": ["Qwen3NextForCausalLM"], "num_experts": 0})):
        with pytest.raises(ModelLoadError, match="disagree"):
            parse({**LLAMA_CFG, **extra, "rope_parameters": {"rope_type": "default",
                                                             "rope_theta": 1e6},
                   "rope_scaling": LINEAR})


@pytest.mark.parametrize("edit", [
    {"rope_scaling": {"rope_type": "linear", "factor": 4}},  # the same, spelled the old way
    {"rope_parameters": None, "rope_theta": 1e4, "rope_scaling": LINEAR},  # the old spelling
    {"rope_scaling": None},
], ids=["same-meaning", "rope-scaling-only", "null-scaling"])
def test_either_rope_spelling_alone_or_both_agreeing_serve_like_transformers(
        tmp_path: Path, edit: dict[str, object]) -> None:
    path = build(tmp_path, "llama", {"rope_parameters": {"rope_type": "linear", "factor": 4.0,
                                                         "rope_theta": 1e4}}, edit=edit)
    ours, theirs, worst = engine_vs_transformers(path, lens=(5, 41), new=6)
    assert worst < 1e-4 and ours == theirs


def test_gpt_oss_rope_without_a_theta_takes_its_class_default(tmp_path: Path) -> None:
    build_gpt_oss_checkpoint(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["rope_parameters"]["rope_theta"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_arch_config(tmp_path).rope.theta == 150000.0
    ours, theirs, worst = engine_vs_transformers(tmp_path, lens=(5, 41), new=6)
    assert worst < 1e-4 and ours == theirs


@pytest.mark.parametrize(("fields", "refused"), [
    ({"head_dim": 80}, True), ({"head_dim": 96}, True), ({"head_dim": 8}, True),
    ({"hidden_size": 400}, True),  # no head_dim field: 400 / 4 heads = 100
    ({"head_dim": 16}, False), ({"head_dim": 128}, False), ({}, False),  # 64 / 4 = 16
])
def test_cuda_refuses_a_head_dim_its_attention_kernels_cannot_tile(
        monkeypatch: pytest.MonkeyPatch, fields: dict[str, int], refused: bool) -> None:
    arch = parse_arch_config({**LLAMA_CFG, **fields})
    loader.check_head_dim(arch, torch.device("cpu"), "ckpt/config.json")  # the CPU serves any
    monkeypatch.setattr(loader.fused, "available", lambda device: True)  # as on a CUDA GPU
    if not refused:
        loader.check_head_dim(arch, torch.device("cuda"), "ckpt/config.json")
        return
    with pytest.raises(ModelLoadError) as exc:
        loader.check_head_dim(arch, torch.device("cuda"), "ckpt/config.json")
    message = str(exc.value)
    assert message.startswith(f"ckpt/config.json: head_dim {arch.head_dim} ")
    assert "\n" not in message


def test_mla_latent_width_is_not_a_head_dim_for_that_rule(monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    build_deepseek_checkpoint(tmp_path, tokenizer=False)  # latent 32 + 8 = 40 elements
    arch = load_arch_config(tmp_path)
    assert arch.head_dim == 40 and arch.kv_latent_dim == 40
    monkeypatch.setattr(loader.fused, "available", lambda device: True)
    loader.check_head_dim(arch, torch.device("cuda"), "ckpt/config.json")
