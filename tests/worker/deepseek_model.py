"""Tiny random DeepSeek-V3 checkpoints written by transformers offline (built into temp dirs).

`build_deepseek_checkpoint(path, **overrides)` saves a `DeepseekV3ForCausalLM` with every
feature switched on and made to matter: MLA with q_lora, YaRN with mscale (so the softmax
scale and the cos/sin factor both differ from 1), DeepSeek's interleaved rope, one dense layer
then MoE layers with grouped top-k routing, a non-zero e_score_correction_bias, a shared
expert and routed_scaling_factor; norms drawn away from 1. `mtp=True` appends the tensors of
one MTP layer (model.layers.{num_hidden_layers}.*) as DeepSeek's release stores them (transformers
writes none). The embedded model's tokenizer files are copied in so a gateway can serve it
(vocab 128, eos 2, as the tokenizer has). `build_deepseek_fp8_checkpoint` makes its FP8
block-scaled copy (models/make_fp8.py) and returns transformers' model on the dequantized
weights. Also a dense Qwen3 twin of the same layers and hidden size for the bytes-per-request
comparison.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
EMBEDDED = REPO / "models" / "tandem-arith"

YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 10000.0,
    "mscale": 0.8,
    "mscale_all_dim": 1.0,
    "beta_fast": 32,
    "beta_slow": 1,
}
CONFIG: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=8,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    max_position_embeddings=256,
    rope_parameters=YARN,
    rope_interleave=True,
    initializer_range=0.1,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)
LATENT_DIM = CONFIG["kv_lora_rank"] + CONFIG["qk_rope_head_dim"]  # 40 elements per token per layer


def _matter(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Norm weights away from 1 and a non-zero routing bias, so a skipped one changes logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_((torch.rand(b.shape, generator=gen) - 0.5) * 0.2)


def _add_mtp_layer(path: Path, config: Any, gen: torch.Generator) -> None:
    """Append model.layers.{N}.* for one MTP layer (a MoE decoder layer + enorm, hnorm, eh_proj,
    shared_head.{norm, head}, embed_tokens) to the checkpoint, as DeepSeek-V3's release has it."""
    from safetensors.torch import load_file, save_file

    n, hidden = config.num_hidden_layers, config.hidden_size
    tensors = load_file(path / "model.safetensors")
    prefix = f"model.layers.{n}"
    template = f"model.layers.{n - 1}."  # the last decoder layer (MoE): its names and shapes
    for name, t in list(tensors.items()):
        if name.startswith(template):
            tensors[prefix + "." + name[len(template) :]] = (
                torch.randn(t.shape, generator=gen) * 0.1
            )
    for extra, shape in (
        ("enorm.weight", (hidden,)),
        ("hnorm.weight", (hidden,)),
        ("shared_head.norm.weight", (hidden,)),
        ("eh_proj.weight", (hidden, 2 * hidden)),
        ("shared_head.head.weight", (config.vocab_size, hidden)),
        ("embed_tokens.weight", (config.vocab_size, hidden)),
    ):
        tensors[f"{prefix}.{extra}"] = torch.randn(shape, generator=gen) * 0.1
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def build_deepseek_checkpoint(
    path: Path, *, seed: int = 0, mtp: bool = False, tokenizer: bool = True, **overrides: Any
) -> torch.nn.Module:
    """Save a tiny random DeepseekV3ForCausalLM (float32) at `path`; returns transformers' model."""
    import transformers

    config = transformers.DeepseekV3Config(**{**CONFIG, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    _matter(model, gen)
    model.save_pretrained(path, safe_serialization=True)
    if mtp:
        _add_mtp_layer(path, config, gen)
    if tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(EMBEDDED / name, path / name)
    return model


def build_dense_twin(path: Path, *, kv_heads: int = 2, seed: int = 0) -> torch.nn.Module:
    """A Qwen3 with the same layers, hidden size and query heads (head_dim 16; MHA with
    kv_heads=4, GQA with 2), for the bytes-shipped-per-request comparison against MLA."""
    from tests.worker.conftest import build_tiny_checkpoint

    model = build_tiny_checkpoint(
        path,
        "qwen3",
        seed=seed,
        vocab_size=CONFIG["vocab_size"],
        hidden_size=CONFIG["hidden_size"],
        num_hidden_layers=CONFIG["num_hidden_layers"],
        num_attention_heads=CONFIG["num_attention_heads"],
        num_key_value_heads=kv_heads,
        head_dim=16,
        max_position_embeddings=CONFIG["max_position_embeddings"],
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED / name, path / name)
    return model


def build_deepseek_fp8_checkpoint(
    path: Path, *, block: tuple[int, int] = (16, 32), **kwargs: Any
) -> torch.nn.Module:
    """The tiny DeepSeek-V3 made FP8 by models/make_fp8.py (DeepSeek's format: e4m3 weights with
    `<name>.weight_scale_inv` block scales; small blocks, so every linear spans several and
    short edge blocks occur) at `path`; returns transformers' model loaded (float32) from the
    dequantized weights: the reference the FP8 checkpoint must serve like."""
    import transformers
    from safetensors.torch import load_file, save_file

    from models.make_fp8 import convert
    from worker.model.fp8 import dequantize_weight

    src = path.parent / f"{path.name}-dequantized"
    build_deepseek_checkpoint(src, **kwargs)
    assert convert(src, path, block) > 0
    tensors = load_file(path / "model.safetensors")
    mtp = f"model.layers.{CONFIG['num_hidden_layers']}."  # transformers has no MTP layer
    dequantized = {
        name: dequantize_weight(t, tensors[name + "_scale_inv"], block)
        if name + "_scale_inv" in tensors
        else t
        for name, t in tensors.items()
        if not name.endswith("_scale_inv") and not name.startswith(mtp)
    }
    save_file(dequantized, src / "model.safetensors", metadata={"format": "pt"})
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    return model.eval()
