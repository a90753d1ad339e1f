"""Fixtures for the model tests: tiny random HF checkpoints and a paged-KV test harness.

`tiny_checkpoint(family, **overrides)` builds a small random transformers model offline,
saves it with `save_pretrained` and returns (path, hf_model). `PagedHarness` plays the
engine's role by hand: it hands out non-contiguous pages and builds `ForwardBatch`es for
steps that mix chunked prefills and decodes.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from worker.batch import ForwardBatch
from worker.kv_cache import KVCache, KVShape
from worker.model.base import CausalLM, ModelSpec

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=97,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    initializer_range=0.2,  # wide logits, so greedy argmax is far from ties
)


def build_tiny_checkpoint(
    path: Path, family: str, max_shard_size: str | None = None, seed: int = 0, **overrides: object
) -> torch.nn.Module:
    import transformers

    config_cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
    }[family]
    kwargs = {**TINY, **overrides}
    if family == "qwen3":
        kwargs.setdefault("head_dim", 16)
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if family == "qwen3":  # HF inits q/k norms to 1; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **save_kwargs)
    return model


@pytest.fixture
def tiny_checkpoint(tmp_path: Path) -> Callable[..., tuple[Path, torch.nn.Module]]:
    counter = iter(range(1000))

    def make(family: str, **overrides: object) -> tuple[Path, torch.nn.Module]:
        path = tmp_path / f"{family}-{next(counter)}"
        return path, build_tiny_checkpoint(path, family, **overrides)

    return make


class PagedHarness:
    """Drives a CausalLM over a KVCache the way the engine would, one step at a time."""

    def __init__(
        self,
        model: CausalLM,
        spec: ModelSpec,
        page_size: int = 4,
        num_pages: int = 64,
        seed: int = 0,
        tp_size: int = 1,
    ) -> None:
        self.model, self.page_size = model, page_size
        kv_heads = spec.num_kv_heads // tp_size  # this rank's heads
        self.kv = KVCache(
            KVShape(num_pages, spec.num_layers, kv_heads, page_size, spec.head_dim, spec.dtype)
        )
        self.free = list(range(1, num_pages))  # page 0 stays unused: it is the page_table padding
        random.Random(seed).shuffle(self.free)  # non-contiguous, out-of-order page ids
        self.pages: dict[str, list[int]] = {}
        self.num_tokens: dict[str, int] = {}

    def step(self, chunks: list[tuple[str, list[int]]]) -> torch.Tensor:
        """Run one step; chunks = (request id, new token ids).
        Returns logits [B, V] of each last token."""
        ids, positions, qs, seq_lens, slots, last = [], [], [0], [], [], []
        for rid, toks in chunks:
            start = self.num_tokens.get(rid, 0)
            end = start + len(toks)
            pages = self.pages.setdefault(rid, [])
            while len(pages) * self.page_size < end:
                pages.append(self.free.pop())
            ids += toks
            positions += range(start, end)
            slots += [
                pages[p // self.page_size] * self.page_size + p % self.page_size
                for p in range(start, end)
            ]
            qs.append(qs[-1] + len(toks))
            seq_lens.append(end)
            last.append(qs[-1] - 1)
            self.num_tokens[rid] = end
        width = max(len(self.pages[rid]) for rid, _ in chunks)
        table = [self.pages[rid] + [0] * (width - len(self.pages[rid])) for rid, _ in chunks]
        batch = ForwardBatch(
            input_ids=torch.tensor(ids),
            positions=torch.tensor(positions),
            query_start=torch.tensor(qs),
            seq_lens=torch.tensor(seq_lens),
            page_table=torch.tensor(table),
            slot_mapping=torch.tensor(slots),
            logits_indices=torch.tensor(last),
            query_start_list=qs,
            seq_lens_list=seq_lens,
        )
        with torch.no_grad():
            hidden = self.model(batch, self.kv)  # [T, hidden]
            return self.model.compute_logits(hidden[batch.logits_indices])  # [B, V]


@pytest.fixture
def paged_harness() -> type[PagedHarness]:
    return PagedHarness
