"""DeepSeek-V3 in DeepSeek's own FP8 format (block-scaled e4m3, `<name>.weight_scale_inv`) on
the CPU, against transformers on the dequantized weights (float32).

- models/make_fp8.py writes DeepSeek's format: which tensors are e4m3 with scales, which stay as
  they are (embeddings, lm_head, norms, the router and its correction bias, the MTP's head);
- the CPU worker (every weight dequantized at load) gives transformers' logits over chunked
  prefills and decodes, and its MTP layer loads from the same checkpoint;
- the model built as a CUDA worker builds it (FP8 linears kept: MLA's q_a | kv_a fused with a
  short last block, q_b, o_proj, dense MLP, shared experts; kv_b_proj, routed experts and
  eh_proj dequantized) loads the same checkpoint and gives the same logits (the CPU runs its FP8
  linears through fp8_gemm's reference route), and `tandem plan`'s byte count equals its bytes;
- config: an FP8 quantization_config is taken, another quant_method refused in one line.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from orchestrator.weights import weight_bytes
from tests.worker.deepseek_model import CONFIG, build_deepseek_fp8_checkpoint
from tests.worker.test_deepseek import latent_harness
from worker.arch.deepseek_config import parse_deepseek_v3
from worker.arch.fp8_config import BlockFp8Config
from worker.arch.load import load_arch_config
from worker.config import ModelConfig, ParallelConfig
from worker.model import ModelLoadError, load_model
from worker.model.base import CausalLM, ModelSpec
from worker.model.deepseek_v3 import DeepseekV3ForCausalLM
from worker.model.fp8 import FP8, dequantize_weight
from worker.model.layers import TPInfo
from worker.model.loader import load_checkpoint, weight_files

BLOCK = (16, 32)  # rows x columns per scale: kv_a's 40 rows and q_lora's 48 columns end short
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [128, 128]}  # DeepSeek-V3's release config.json


@pytest.fixture(scope="module")
def fp8_v3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("deepseek-v3-fp8") / "ckpt"
    return path, build_deepseek_fp8_checkpoint(path, block=BLOCK, mtp=True, tokenizer=False)


def _fp8_kept_model(path: Path) -> DeepseekV3ForCausalLM:
    """The model as a CUDA worker builds and fills it (quant kept), here on the CPU."""
    arch = load_arch_config(path)
    assert arch.quant == BlockFp8Config(*BLOCK, modules_to_not_convert=("lm_head",))
    with torch.device("meta"):
        lm = DeepseekV3ForCausalLM(arch, TPInfo(), None, torch.float32)
    lm = lm.to_empty(device="cpu")
    load_checkpoint(lm, weight_files(path), arch.quant)
    return lm.eval()


def _worst_logit_diff(model: CausalLM, spec: ModelSpec, hf: torch.nn.Module) -> float:
    """Chunked prefills interleaved with decodes over latent pages vs transformers' logits."""
    harness = latent_harness(model, spec)
    rng = random.Random(3)
    seqs = {r: [rng.randrange(128) for _ in range(n)] for r, n in (("a", 28), ("b", 21))}
    with torch.no_grad():
        ref = {r: hf(torch.tensor([s])).logits[0] for r, s in seqs.items()}  # [L, V]
    worst, pos = 0.0, dict.fromkeys(seqs, 0)
    decode = [("a", 1), ("b", 1)]
    for chunks in ([("a", 11)], [("a", 9), ("b", 12)], [("a", 6), ("b", 7)], decode, decode):
        step = [(r, seqs[r][pos[r] : pos[r] + n]) for r, n in chunks]
        for (r, toks), row in zip(step, harness.step(step), strict=True):
            pos[r] += len(toks)
            worst = max(worst, float((row - ref[r][pos[r] - 1]).abs().max()))
    assert pos == {r: len(s) for r, s in seqs.items()}
    return worst


def test_make_fp8_writes_deepseeks_format(fp8_v3: tuple[Path, torch.nn.Module]) -> None:
    path, _ = fp8_v3
    cfg = json.loads((path / "config.json").read_text())["quantization_config"]
    assert {k: cfg[k] for k in FP8_CONFIG} == {**FP8_CONFIG, "weight_block_size": list(BLOCK)}
    n = CONFIG["num_hidden_layers"]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        dtypes = {name: f.get_slice(name).get_dtype() for name in names}
    fp8 = {name for name, dt in dtypes.items() if dt.startswith("F8")}
    assert fp8 == {name.removesuffix("_scale_inv") for name in names if name.endswith("_scale_inv")}
    attn, mlp, mtp = "model.layers.1.self_attn.", "model.layers.1.mlp.", f"model.layers.{n}."
    for linear in (
        *(attn + p for p in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")),
        "model.layers.0.mlp.gate_proj", mlp + "shared_experts.down_proj",
        mlp + "experts.7.up_proj", mtp + "eh_proj", mtp + "self_attn.kv_b_proj",
    ):
        assert linear + ".weight" in fp8 and dtypes[linear + ".weight_scale_inv"] == "F32"
    for kept in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 attn + "kv_a_layernorm.weight", attn + "q_a_layernorm.weight",
                 mlp + "gate.weight", mlp + "gate.e_score_correction_bias",
                 mtp + "shared_head.head.weight", mtp + "embed_tokens.weight",
                 mtp + "enorm.weight"):
        assert dtypes[kept] == "F32", kept  # the source's dtype (float32 here)


def test_cpu_worker_dequantizes_and_equals_transformers(
    fp8_v3: tuple[Path, torch.nn.Module],
) -> None:
    path, hf = fp8_v3
    model, spec = load_model(ModelConfig(path=str(path)), ParallelConfig())
    assert not any(p.dtype == FP8 for p in model.parameters())  # the CPU has no FP8 kernels
    assert _worst_logit_diff(model, spec, hf) < 1e-4
    mtp = model.mtp[0]  # type: ignore[index]  # the MTP layer, from the same FP8 checkpoint
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        name = f"model.layers.{CONFIG['num_hidden_layers']}.eh_proj.weight"
        want = dequantize_weight(f.get_tensor(name), f.get_tensor(name + "_scale_inv"), BLOCK)
    assert torch.equal(mtp.eh_proj.weight, want)


def test_cuda_layout_keeps_fp8_linears_and_equals_transformers(
    fp8_v3: tuple[Path, torch.nn.Module],
) -> None:
    path, hf = fp8_v3
    lm = _fp8_kept_model(path)
    dense, moe = lm.model.layers[0], lm.model.layers[1]
    kept = [moe.self_attn.qkv_a_proj, moe.self_attn.q_b_proj, moe.self_attn.o_proj,
            dense.mlp.gate_up_proj, dense.mlp.down_proj,
            moe.mlp.shared_experts.gate_up_proj, lm.mtp[0].block.self_attn.o_proj]
    for linear in kept:
        assert linear.weight.dtype == FP8 and linear.weight_scale_inv.dtype == torch.float32
    # q_lora 48 rows (3 blocks of 16) | kv_a 40 rows (2.5 blocks): 3 + 3 scale rows
    assert moe.self_attn.qkv_a_proj.weight_scale_inv.shape == (6, 2)
    for held in (moe.self_attn.kv_b_proj.weight, moe.mlp.w13, moe.mlp.w2, lm.mtp[0].eh_proj.weight,
                 moe.mlp.gate, lm.model.embed_tokens.weight, lm.lm_head.weight):
        assert held.dtype == torch.float32
    _, spec = load_model(ModelConfig(path=str(path), load_format="dummy"), ParallelConfig())
    assert _worst_logit_diff(lm, spec, hf) < 1e-4
    # `tandem plan` on CUDA counts what this model holds (float32: every unquantized tensor at 4
    # bytes), bar the MTP layer's copies of the embedding and head, which the loader skips.
    held_bytes = sum(p.numel() * p.element_size() for p in lm.parameters())
    mtp_copies = 2 * CONFIG["vocab_size"] * CONFIG["hidden_size"] * 4
    hf_cfg = json.loads((path / "config.json").read_text())
    planned = weight_bytes(str(path), hf_cfg, "float32", "cuda")
    assert planned is not None and planned.exact and planned.dtype == "float8_e4m3fn + float32"
    assert planned.total == held_bytes + mtp_copies


def test_fp8_quantization_config_is_taken_and_others_refused_in_one_line() -> None:
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], **CONFIG, "quantization_config": FP8_CONFIG}
    assert parse_deepseek_v3(cfg, None, "config.json").quant == BlockFp8Config(128, 128)
    awq = {**cfg, "quantization_config": {"quant_method": "awq", "bits": 4}}
    with pytest.raises(ModelLoadError) as err:
        parse_deepseek_v3(awq, None, "config.json")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("config.json: quantization_config.quant_method 'awq'")
