"""CUDA graphs for speculative decoding's verify steps: B requests x (k + 1) tokens each.

A verify step is a decode step whose requests each feed their last token and up to k drafts
(worker/spec/). Like a decode step its GPU work is small next to its ~550 kernel launches at
batch 1, so it is captured once per padded batch-size bucket at one query width `w = k + 1`,
and replayed, over worker/row_graphs.py's static buffers and padding: a request with fewer
drafts (an n-gram miss, max_tokens near) fills its first 1 + len(drafts) rows; padding
requests have seq_len 0 and slots -1, as decode graphs' padding rows do. Attention runs as one
paged kernel over device tensors only (`ForwardBatch.uniform_query_len` = w,
worker/model/triton_attention.py): no host list is read, so the graph replays any step.
`run` returns the hidden states and logits of the real rows in plan order (a gather by row
index), what an eager verify returns: the sampler and a model drafter's catch-up read them.

FP8 KV pages are not captured (the paged kernel reads no K/V scales): those steps run eagerly.
`eager(chunks)` runs the same padded batch without a graph, on any device: the CPU tests check
the padding against the plain step there.
"""

from __future__ import annotations

import torch

from worker.kv_cache import KVCache
from worker.model import CausalLM
from worker.row_graphs import RowGraphs
from worker.step import ScheduledChunk


class VerifyGraphs(RowGraphs):
    def __init__(self, model: CausalLM, kv: KVCache, max_num_seqs: int, max_model_len: int,
                 num_speculative_tokens: int) -> None:
        width = num_speculative_tokens + 1  # query rows per request
        super().__init__(kv, max_num_seqs, max_model_len, width, reach=width)
        self.model = model

    def _forward(self, bs: int, seq_lens: list[int] | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model(self._batch(bs, seq_lens), self.kv)  # [bs*w, hidden]
        return hidden, self.model.compute_logits(hidden)  # [bs*w, vocab] fp32

    def fits(self, chunks: list[ScheduledChunk]) -> bool:
        """A plan these graphs replay: every chunk samples, from its last token (and drafts)."""
        return (self.bucket_for(len(chunks)) in self._graphs
                and all(c.sample and c.num_tokens == 1 + len(c.drafts) <= self.width
                        and c.request.output_token_ids for c in chunks))

    def _rows(self, chunks: list[ScheduledChunk], bs: int) -> tuple[torch.Tensor, list[int]]:
        real = self.fill([c.start for c in chunks], [c.input_ids() for c in chunks],
                         [c.request.page_table for c in chunks], bs)
        return self.rows(real), [c.start + self.width for c in chunks]

    def run(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay for a verify plan (`fits`) → (hidden [T, H], logits [T, V]) of its real rows,
        in plan order."""
        bs = self.bucket_for(len(chunks))
        assert bs is not None and bs in self._graphs, f"no verify graph for {len(chunks)}"
        real, lens = self._rows(chunks, bs)
        hidden, logits = self.replay(bs, lens)
        return hidden.index_select(0, real), logits.index_select(0, real)

    @torch.inference_mode()
    def eager(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        """The same padded step without a graph, on any device (no bucket padding: the CPU
        reference backend loops over requests and reads the host lengths)."""
        real, lens = self._rows(chunks, len(chunks))
        hidden, logits = self._forward(len(chunks), lens)
        return hidden.index_select(0, real), logits.index_select(0, real)
