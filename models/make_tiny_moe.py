"""Write a small random Qwen3-MoE checkpoint (HF format: config.json + model.safetensors).

Tests build it into a temporary directory; nothing large is committed. Usage:
    python models/make_tiny_moe.py OUT_DIR [--seed N] [--experts E] [--top-k K]

The shape exercises what matters: GQA with 2 kv heads (one per rank at TP=2), 4 experts
(two per rank at EP=2), top-2 routing with renormalized weights, one dense layer
(`mlp_only_layers`) between sparse ones, an odd vocabulary (vocab-parallel padding), and a
wide init so greedy argmax is far from ties.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY_MOE = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=97,
    max_position_embeddings=128,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[1],
    rms_norm_eps=1e-6,
    initializer_range=0.2,
)


def make_tiny_moe(out: Path, seed: int = 0, **overrides: object) -> torch.nn.Module:
    """Build, save and return the transformers model (the reference for fidelity tests)."""
    import transformers

    config = transformers.Qwen3MoeConfig(**{**TINY_MOE, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # HF inits q/k norms to 1; make them matter
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:  # transformers 5 inits the router to zeros: every expert ties
                gate.weight.normal_(0.0, 0.5)
    model.save_pretrained(out)
    return model


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--experts", type=int, default=TINY_MOE["num_experts"])
    ap.add_argument("--top-k", type=int, default=TINY_MOE["num_experts_per_tok"])
    args = ap.parse_args()
    make_tiny_moe(args.out, args.seed, num_experts=args.experts, num_experts_per_tok=args.top_k)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
