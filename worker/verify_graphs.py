"""CUDA graphs for speculative decoding's verify steps: B requests x (k + 1) tokens each.

A verify step is a decode step whose requests each feed their last token and up to k drafts
(worker/spec/). Like a decode step its GPU work is small next to its ~550 kernel launches at
batch 1, so it is captured once per padded batch-size bucket (worker/cuda_graphs.py's buckets)
at one query width `w = k + 1`, and replayed:

- Every request owns rows [i*w, (i+1)*w) of the static buffers. A request with fewer drafts
  (an n-gram miss, max_tokens near) fills its first 1 + len(drafts) rows; the rest are padding:
  token 0, the positions after its last real one (clamped to the context), slot -1 (their K/V
  are never stored), so its real rows attend to exactly their own context. Padding requests
  (past B in the bucket) have seq_len 0 and slots -1, as decode graphs' padding rows do.
- Attention runs as one paged kernel over device tensors only (`ForwardBatch.uniform_query_len`
  = w, worker/model/triton_attention.py): no host list is read, so the graph replays any step.
- `run` returns the hidden states and logits of the real rows in plan order (a gather by row
  index), what an eager verify returns: the sampler and a model drafter's catch-up read them.

FP8 KV pages are not captured (the paged kernel reads no K/V scales): those steps run eagerly.
`eager(chunks)` runs the same padded batch without a graph, on any device: the CPU tests check
the padding against the plain step there.
"""

from __future__ import annotations

import torch

from worker.batch import ForwardBatch
from worker.cuda_graphs import graph_buckets
from worker.kv_cache import KVCache
from worker.model import CausalLM
from worker.step import ScheduledChunk


class VerifyGraphs:
    def __init__(self, model: CausalLM, kv: KVCache, max_num_seqs: int, max_model_len: int,
                 num_speculative_tokens: int) -> None:
        self.model, self.kv = model, kv
        self.page_size = kv.shape.page_size
        self.width = num_speculative_tokens + 1  # query rows per request
        self.max_model_len = max_model_len
        self.buckets = graph_buckets(max_num_seqs)
        self.max_bs = self.buckets[-1]
        self.max_pages = -(-(max_model_len + self.width) // self.page_size)
        device = kv.data.device
        b, t = self.max_bs, self.max_bs * self.width
        # ids | positions | slots (one per row), seq_lens (one per request), then the page table
        self._head = 3 * t + b
        size = self._head + b * self.max_pages
        self._flat = torch.zeros(size, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.slots = self._flat[: 3 * t].view(3, t)
        self.seq_lens = self._flat[3 * t : self._head]
        self.page_table = self._flat[self._head :].view(b, self.max_pages)  # [Bmax, max_pages]
        self.query_start = torch.arange(0, (b + 1) * self.width, self.width, dtype=torch.int64,
                                        device=device)  # [Bmax+1]
        self.all_rows = torch.arange(t, dtype=torch.int64, device=device)
        pinned = device.type == "cuda"
        self._host = torch.zeros(size, dtype=torch.int64, pin_memory=pinned)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # bucket → (hidden, logits)
        self.num_replays = 0

    def _batch(self, bs: int, seq_lens: list[int] | None = None) -> ForwardBatch:
        """The static batch of one bucket. `seq_lens`: the host copy, for `eager` (the CUDA
        kernel reads none, so captured graphs get placeholders)."""
        t, w = bs * self.width, self.width
        return ForwardBatch(
            input_ids=self.input_ids[:t], positions=self.positions[:t],
            query_start=self.query_start[: bs + 1], seq_lens=self.seq_lens[:bs],
            page_table=self.page_table[:bs], slot_mapping=self.slots[:t],
            logits_indices=self.all_rows[:t],
            # Placeholders for the CUDA kernel (it reads none); exact for `eager` on the CPU.
            query_start_list=list(range(0, (bs + 1) * w, w)),
            seq_lens_list=seq_lens if seq_lens is not None else [w] * bs,
            uniform_query_len=w,
        )

    def _forward(self, bs: int, seq_lens: list[int] | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model(self._batch(bs, seq_lens), self.kv)  # [bs*w, hidden]
        return hidden, self.model.compute_logits(hidden)  # [bs*w, vocab] fp32

    def fits(self, chunks: list[ScheduledChunk]) -> bool:
        """A plan these graphs replay: every chunk samples, from its last token (and drafts)."""
        return (self.bucket_for(len(chunks)) in self._graphs
                and all(c.sample and c.num_tokens == 1 + len(c.drafts) <= self.width
                        and c.request.output_token_ids for c in chunks))

    def bucket_for(self, batch_size: int) -> int | None:
        for bs in self.buckets:
            if bs >= batch_size:
                return bs
        return None

    @torch.inference_mode()
    def capture(self) -> None:
        self.slots.fill_(-1)
        self.seq_lens.zero_()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bs in self.buckets:
                for _ in range(2):  # Triton compiles, the allocator settles
                    self._forward(bs)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for bs in reversed(self.buckets):  # largest first: smaller graphs reuse its pool
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._out[bs] = self._forward(bs)
            self._graphs[bs] = graph
        torch.cuda.synchronize()

    def _fill(self, chunks: list[ScheduledChunk], bs: int) -> torch.Tensor:
        """Write the plan into the static buffers of bucket `bs`; returns the real rows."""
        n, w, ps = len(chunks), self.width, self.page_size
        host = self._host
        t = self.max_bs * w
        ids, pos, slots = host[: 3 * t].view(3, t)
        lens = host[3 * t : self._head]
        table = host[self._head :].view(self.max_bs, self.max_pages)
        real: list[int] = []
        last = self.max_model_len - 1
        for i, c in enumerate(chunks):
            req, start = c.request, c.start
            pages = req.page_table
            tokens = c.input_ids()
            k = len(tokens)
            row = i * w
            ids[row : row + w] = 0
            ids[row : row + k] = torch.as_tensor(tokens)
            # Padding rows continue the positions (clamped: the rope table ends at the context).
            pos[row : row + w] = torch.arange(start, start + w).clamp(max=last)
            slots[row : row + w] = -1
            slots[row : row + k] = torch.as_tensor(
                [pages[p // ps] * ps + p % ps for p in range(start, start + k)])
            lens[i] = start + w  # the kernel's rows sit at seq_len - w ..: the real ones first
            table[i].zero_()
            table[i, : len(pages)] = torch.as_tensor(pages)
            real.extend(range(row, row + k))
        lens[n:bs] = 0
        slots[n * w : bs * w] = -1
        # ids | positions | slots | seq_lens whole (their rows are bucket-strided), then the
        # page table rows of this bucket; one pinned host → device copy each.
        self._flat[: self._head].copy_(host[: self._head], non_blocking=True)
        end = self._head + bs * self.max_pages
        self._flat[self._head : end].copy_(host[self._head : end], non_blocking=True)
        return torch.tensor(real, dtype=torch.int64).to(self._flat.device, non_blocking=True)

    def run(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay for a verify plan (`fits`) → (hidden [T, H], logits [T, V]) of its real rows,
        in plan order."""
        bs = self.bucket_for(len(chunks))
        assert bs is not None and bs in self._graphs, f"no verify graph for {len(chunks)}"
        real = self._fill(chunks, bs)
        self._graphs[bs].replay()
        self.num_replays += 1
        hidden, logits = self._out[bs]
        return hidden.index_select(0, real), logits.index_select(0, real)

    @torch.inference_mode()
    def eager(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        """The same padded step without a graph, on any device (no bucket padding: the CPU
        reference backend loops over requests and reads the host lengths)."""
        n = len(chunks)
        real = self._fill(chunks, n)
        lens = [c.start + self.width for c in chunks]
        hidden, logits = self._forward(n, lens)
        return hidden.index_select(0, real), logits.index_select(0, real)
