"""The tiny hybrid window checkpoint the window tests share
(built into a temp dir, never committed).

A Qwen2 config with `use_sliding_window` and `max_window_layers=1`: layer 0 attends to the whole
context (so answers can depend on the start of the prompt), layers 1..3 keep a window of
WINDOW tokens. Random weights: enough for equivalence against transformers. Also a same-size
all-full-attention twin (window off) for the bytes-per-request comparison.
"""

from __future__ import annotations

from pathlib import Path

import torch

WINDOW = 8  # tokens; 2 pages of 4 -> rings of 3 pages
NUM_LAYERS = 4


def build_window_checkpoint(path: Path, *, window: bool = True, seed: int = 0) -> torch.nn.Module:
    """Save a tiny hybrid (window=True) or all-full (window=False) Qwen2 checkpoint at `path`."""
    from tests.worker.conftest import build_tiny_checkpoint

    return build_tiny_checkpoint(
        path,
        "qwen2",
        seed=seed,
        num_hidden_layers=NUM_LAYERS,
        max_position_embeddings=256,
        use_sliding_window=window,
        sliding_window=WINDOW,
        max_window_layers=1,
    )
