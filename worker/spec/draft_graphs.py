"""CUDA graphs for a model drafter's draft steps (B requests x one token) and its catch-up.

`ModelDrafter.draft` runs k - 1 (eagle / mtp) or k (draft model) head steps per verify, each a
single-token step over every drafting request, and `catch_up` one head forward after every
step over the positions it verified. Eagerly each is a few dozen launches from Python plus a
handful of small host → device copies (bench/spec_gpu.py on an H200, batch 1, a head of the 8B
shape whose weights take ~0.4 ms to read: ~1.4 ms a draft step, 1.8 ms a catch-up), so both
are captured once per padded batch-size bucket over worker/row_graphs.py's static buffers:

- `DraftGraphs` (w = 1): request i feeds its last token or draft at its next position; the
  head's input features [Bmax, H] (eagle / mtp: the previous step's) are copied in on the
  device. `run` returns the features and logits of the real rows (views into graph memory,
  valid until the next replay: the drafter reads them before its next step). FP8 KV pages too
  (the decode kernel reads their scales).
- `CatchUpGraphs` (w = k + 1): the catch-up after a decode or verify step (the verified token
  and the accepted drafts), padded as the verify graphs pad; not over FP8 KV pages (the paged
  kernel reads no scales). `run` returns each request's feature at its last real position
  (eagle / mtp: what the next draft starts from).

Which heads: those whose steps read no host value (`DraftHead.graph_safe`): the EAGLE head,
the dense MTP module and a draft model, with a rope that does not depend on the request's
length. A prompt chunk's catch-up and eagle's first draft (the LM head alone) stay eager.
"""

from __future__ import annotations

import torch

from worker.kv_cache import KVCache
from worker.row_graphs import RowGraphs
from worker.spec.heads import DraftHead


class _HeadGraphs(RowGraphs):
    """Graphs of a head's forward at `width` rows a request, with its input features."""

    def __init__(self, head: DraftHead, kv: KVCache, max_num_seqs: int, max_model_len: int,
                 width: int, num_speculative_tokens: int, hidden_size: int,
                 dtype: torch.dtype) -> None:
        # Draft positions reach k + 1 past the context (a catch-up row's padding too).
        super().__init__(kv, max_num_seqs, max_model_len, width, num_speculative_tokens + 1)
        self.head = head
        self.hidden = (torch.zeros(self.max_bs * width, hidden_size, dtype=dtype,
                                   device=kv.data.device)
                       if head.needs_hidden else None)  # [Bmax*w, H]

    def _features(self, bs: int, seq_lens: list[int] | None) -> torch.Tensor:
        hidden = self.hidden[: bs * self.width] if self.hidden is not None else None
        return self.head(self._batch(bs, seq_lens), self.kv, hidden)  # [bs*w, H]

    def _bucket(self, n: int) -> int:
        bs = self.bucket_for(n) if self.replays else n  # the CPU reference reads host lengths
        assert bs is not None, f"no {type(self).__name__} graph for {n} requests"
        return bs


class DraftGraphs(_HeadGraphs):
    def __init__(self, head: DraftHead, kv: KVCache, max_num_seqs: int, max_model_len: int,
                 num_speculative_tokens: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__(head, kv, max_num_seqs, max_model_len, 1, num_speculative_tokens,
                         hidden_size, dtype)

    def _forward(self, bs: int, seq_lens: list[int] | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        feats = self._features(bs, seq_lens)
        return feats, self.head.compute_logits(feats)  # [bs, V] fp32

    @torch.inference_mode()
    def run(self, tokens: list[int], positions: list[int], tables: list[list[int]],
            hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step: request i feeds tokens[i] at positions[i] over its page table
        tables[i] → (features [n, H], logits [n, V] fp32) of the real rows. `hidden` [n, H]:
        the head's inputs (eagle / mtp), on the device."""
        n = len(tokens)
        bs = self._bucket(n)
        self.fill(positions, [[t] for t in tokens], tables, bs)
        if self.hidden is not None:
            assert hidden is not None, "an eagle / mtp head is fed features"
            self.hidden[:n].copy_(hidden)
        feats, logits = self.replay(bs, [p + 1 for p in positions])
        return feats[:n], logits[:n]


class CatchUpGraphs(_HeadGraphs):
    def __init__(self, head: DraftHead, kv: KVCache, max_num_seqs: int, max_model_len: int,
                 num_speculative_tokens: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__(head, kv, max_num_seqs, max_model_len, num_speculative_tokens + 1,
                         num_speculative_tokens, hidden_size, dtype)

    def _forward(self, bs: int, seq_lens: list[int] | None = None) -> torch.Tensor:
        return self._features(bs, seq_lens)

    @torch.inference_mode()
    def run(self, starts: list[int], tokens: list[list[int]], tables: list[list[int]],
            hidden: torch.Tensor | None) -> torch.Tensor:
        """Request i feeds tokens[i] (1..w of them) from position starts[i] over its page table
        tables[i]; `hidden` [sum of lengths, H]: the head's inputs in that order (eagle /
        mtp). → features [n, H] at each request's last real position."""
        bs = self._bucket(len(starts))
        real = self.fill(starts, tokens, tables, bs)
        if self.hidden is not None:
            assert hidden is not None, "an eagle / mtp head catches up on the target's states"
            self.hidden.index_copy_(0, self.rows(real), hidden.to(self.hidden.dtype))
        feats = self.replay(bs, [s + self.width for s in starts])
        last, end = [], 0
        for toks in tokens:
            end += len(toks)
            last.append(real[end - 1])
        return feats.index_select(0, self.rows(last))
