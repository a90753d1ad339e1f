"""The tiny Qwen3-Next checkpoint the Qwen3-Next tests share, and a harness that drives the model
with hand-built ForwardBatches over a KVCache with a state region (the engine's job, by hand).

The checkpoint: 4 layers, Gated DeltaNet at 0, 1, 3 and gated attention at 2 (so a DeltaNet
layer reads a full-attention layer's output); GQA in both mixers (2 key / 4 value heads in the
DeltaNet, 4 query / 2 kv heads in attention); partial rotary 0.25 of head_dim 32; MoE (4 experts,
top 2, a shared expert) everywhere except layer 1 (`mlp_only_layers`: a dense MLP). Random
weights, written by transformers offline in float32, with the embedded model's tokenizer files
(vocab 128) so the gateway can load a tokenizer. Norm weights are perturbed away from their
init so that the zero-centred (1 + w) and the plain gated-norm weights both matter.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import torch

from worker.batch import ForwardBatch
from worker.kv_cache import KVCache, KVShape
from worker.model.base import CausalLM, ModelSpec

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[2]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
CONFIG = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, layer_types=LAYER_TYPES,
    linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=8,
    linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=48, decoder_sparse_step=1,
    mlp_only_layers=[1], max_position_embeddings=512, rms_norm_eps=1e-6,
    initializer_range=0.1, eos_token_id=2, pad_token_id=0,
)


def build_qwen3_next_checkpoint(path: Path, seed: int = 0, **overrides: object) -> torch.nn.Module:
    """Save a tiny random Qwen3NextForCausalLM (float32) plus tokenizer files at `path`."""
    import transformers

    config = transformers.Qwen3NextConfig(**{**CONFIG, **overrides})
    torch.manual_seed(seed)
    model = transformers.Qwen3NextForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("layernorm.weight", "_norm.weight")) or name == "model.norm.weight":
                p.normal_(0.0, 0.3)  # zero-centred norms: the model uses 1 + w
            elif name.endswith("linear_attn.norm.weight"):
                p.uniform_(0.5, 1.5)  # the gated norm: a plain weight
            elif name.endswith("dt_bias"):
                p.uniform_(-1.0, 1.0)
    model.save_pretrained(path, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(REPO / "models" / "tandem-arith" / name, path / name)
    return model


class StateHarness:
    """Drives a model with recurrent layers the way the engine will: pages for the attention
    layers, one state slot per request (zeroed at its first chunk), out-of-order ids for both."""

    def __init__(
        self, model: CausalLM, spec: ModelSpec, page_size: int = 4, num_pages: int = 128,
        num_slots: int = 8, tp_size: int = 1, seed: int = 0, device: str = "cpu",
    ) -> None:
        self.model, self.page_size, self.device = model, page_size, device
        self.kv = KVCache(KVShape(
            num_pages, spec.num_layers, max(1, spec.num_kv_heads // tp_size), page_size,
            spec.head_dim, spec.dtype, state_layers=spec.state_layers, state=spec.state_shape,
            num_state_slots=num_slots,
        ), device)
        rng = random.Random(seed)
        self.free = list(range(1, num_pages))  # page 0 stays unused: the page_table padding
        rng.shuffle(self.free)
        self.free_slots = list(range(num_slots))
        rng.shuffle(self.free_slots)
        self.pages: dict[str, list[int]] = {}
        self.slot: dict[str, int] = {}
        self.num_tokens: dict[str, int] = {}

    def start_from(self, rid: str, source: str, num_tokens: int) -> None:
        """A new request `rid` resuming from `source`'s state after `num_tokens` (a prefix hit):
        its pages are shared, its state slot a copy of the source's (taken right then)."""
        assert num_tokens % self.page_size == 0, "prefix hits (and snapshots) are page-aligned"
        pages = self.pages[source][: num_tokens // self.page_size]
        self.pages[rid] = list(pages)
        self.slot[rid] = self.free_slots.pop()
        self.kv.copy_state(self._t([self.slot[source]]), self._t([self.slot[rid]]))
        self.num_tokens[rid] = num_tokens

    def release(self, rid: str) -> None:
        self.free_slots.append(self.slot.pop(rid))

    def step(self, chunks: list[tuple[str, list[int]]], all_rows: bool = False) -> torch.Tensor:
        """One step; chunks = (request id, new token ids). Returns the logits of each request's
        last token [B, V] (all_rows: of every token [T, V])."""
        ids, positions, qs, seq_lens, slots, last, state_slots = [], [], [0], [], [], [], []
        for rid, toks in chunks:
            start = self.num_tokens.get(rid, 0)
            if rid not in self.slot:
                self.slot[rid] = self.free_slots.pop()
                self.kv.zero_state(self._t([self.slot[rid]]))
            end = start + len(toks)
            pages = self.pages.setdefault(rid, [])
            while len(pages) * self.page_size < end:
                pages.append(self.free.pop())
            ids += toks
            positions += range(start, end)
            slots += [pages[p // self.page_size] * self.page_size + p % self.page_size
                      for p in range(start, end)]
            qs.append(qs[-1] + len(toks))
            seq_lens.append(end)
            last.append(qs[-1] - 1)
            state_slots.append(self.slot[rid])
            self.num_tokens[rid] = end
        width = max(len(self.pages[rid]) for rid, _ in chunks)
        table = [self.pages[rid] + [0] * (width - len(self.pages[rid])) for rid, _ in chunks]
        t = self._t
        batch = ForwardBatch(
            input_ids=t(ids), positions=t(positions), query_start=t(qs), seq_lens=t(seq_lens),
            page_table=t(table), slot_mapping=t(slots), logits_indices=t(last),
            query_start_list=qs, seq_lens_list=seq_lens, state_slots=t(state_slots),
        )
        with torch.no_grad():
            hidden = self.model(batch, self.kv)  # [T, hidden]
            rows = hidden if all_rows else hidden[batch.logits_indices]
            return self.model.compute_logits(rows).cpu()

    def _t(self, values: list) -> torch.Tensor:
        return torch.tensor(values, device=self.device)
