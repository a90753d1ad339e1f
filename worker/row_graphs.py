"""CUDA graphs over B requests x w query rows each: the verify step, a model drafter's draft
steps (w = 1) and its catch-up (worker/verify_graphs.py, worker/spec/draft_graphs.py).

Each is a step whose GPU work is small next to its launches, so it is captured once per padded
batch-size bucket (worker/cuda_graphs.py's buckets) and replayed. `RowGraphs` holds what they
share:

- Static device buffers: ids | positions | slots (one per row) | seq_lens (one per request) in
  one flat int64 buffer, then the page table; one pinned host → device copy per step
  (`fill`). Request i owns rows [i*w, (i+1)*w): its real rows first, then padding rows (token
  0, positions continued and clamped to the context, slot -1: never stored), so its real rows
  attend to exactly their own context; padding requests (past B in the bucket) have seq_len 0.
- `capture()`: every row padding (no page is written), then worker/cuda_graphs.py's
  `capture_buckets`.
- `replay(bs, seq_lens)`: the bucket's graph, or on a CPU (nothing to capture) an eager run
  over the same buffers, with no bucket padding (the CPU reference reads the host lengths).

Attention reads device tensors only: with w = 1 the decode kernel, with w > 1 the paged kernel
at `ForwardBatch.uniform_query_len` = w (which reads no FP8 K/V scales). A subclass says what
one bucket computes (`_forward`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from worker.batch import ForwardBatch
from worker.cuda_graphs import capture_buckets, graph_buckets
from worker.kv_cache import KVCache


class RowGraphs(ABC):
    def __init__(self, kv: KVCache, max_num_seqs: int, max_model_len: int, width: int,
                 reach: int) -> None:
        """`width` rows per request; positions reach `reach` past max_model_len (the pages a
        step may touch beyond the verified context)."""
        self.kv = kv
        self.replays = kv.data.is_cuda  # False on a CPU: each step runs eagerly (module doc)
        self.page_size = kv.shape.page_size
        self.width = width
        self.max_model_len = max_model_len
        self.buckets = graph_buckets(max_num_seqs)
        self.max_bs = self.buckets[-1]
        self.max_pages = -(-(max_model_len + reach) // self.page_size)
        device = kv.data.device
        b, t = self.max_bs, self.max_bs * width
        self._head = 3 * t + b  # ids | positions | slots (one per row), seq_lens, page table
        size = self._head + b * self.max_pages
        self._flat = torch.zeros(size, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.slots = self._flat[: 3 * t].view(3, t)
        self.seq_lens = self._flat[3 * t : self._head]
        self.page_table = self._flat[self._head :].view(b, self.max_pages)  # [Bmax, max_pages]
        self.query_start = torch.arange(0, (b + 1) * width, width, dtype=torch.int64,
                                        device=device)  # [Bmax+1]
        self.all_rows = torch.arange(t, dtype=torch.int64, device=device)
        self._host = torch.zeros(size, dtype=torch.int64, pin_memory=self.replays)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._out: dict[int, Any] = {}  # bucket → what its graph returns (_forward's value)
        self.num_replays = 0

    @abstractmethod
    def _forward(self, bs: int, seq_lens: list[int] | None = None) -> Any:
        """What one bucket computes over the static buffers (captured, or run on a CPU)."""

    def _batch(self, bs: int, seq_lens: list[int] | None = None) -> ForwardBatch:
        """The static batch of bucket `bs`. `seq_lens`: the host lengths, for the CPU (the CUDA
        kernels read none, so captured graphs get placeholders)."""
        t, w = bs * self.width, self.width
        return ForwardBatch(
            input_ids=self.input_ids[:t], positions=self.positions[:t],
            query_start=self.query_start[: bs + 1], seq_lens=self.seq_lens[:bs],
            page_table=self.page_table[:bs], slot_mapping=self.slots[:t],
            logits_indices=self.all_rows[:t], query_start_list=list(range(0, (bs + 1) * w, w)),
            seq_lens_list=seq_lens if seq_lens is not None else [w] * bs,
            uniform_query_len=w if w > 1 else 0,
        )

    def bucket_for(self, batch_size: int) -> int | None:
        for bs in self.buckets:
            if bs >= batch_size:
                return bs
        return None

    @torch.inference_mode()
    def capture(self) -> None:
        self.slots.fill_(-1)
        self.seq_lens.zero_()
        if self.replays:
            self._graphs, self._out = capture_buckets(self.buckets, self._forward)

    def fill(self, starts: list[int], tokens: list[list[int]], tables: list[list[int]],
             bs: int) -> list[int]:
        """Request i feeds tokens[i] (1..w of them) from position starts[i] over its page table
        tables[i]: write bucket `bs`'s buffers (padding past them) and copy them to the
        device. Returns the real rows, in request order."""
        n, w, ps = len(starts), self.width, self.page_size
        host = self._host
        t = self.max_bs * w
        # numpy views of the host buffer: element and slice stores from lists cost a fraction of
        # a tensor's __setitem__ (worker/cuda_graphs.py DecodeGraphs.fill does the same)
        flat = host.numpy()
        ids, pos, slots = flat[: 3 * t].reshape(3, t)
        lens = flat[3 * t : self._head]
        table = flat[self._head :].reshape(self.max_bs, self.max_pages)
        real: list[int] = []
        last = self.max_model_len - 1
        for i, (start, toks, pages) in enumerate(zip(starts, tokens, tables, strict=True)):
            k, row = len(toks), i * w
            ids[row : row + w] = 0
            ids[row : row + k] = toks
            # Padding rows continue the positions (clamped: the rope table ends at the context).
            pos[row : row + w] = [min(p, last) for p in range(start, start + w)]
            slots[row : row + w] = -1
            slots[row : row + k] = [pages[p // ps] * ps + p % ps for p in range(start, start + k)]
            lens[i] = start + w  # the kernel's rows sit at seq_len - w ..: the real ones first
            used = min(len(pages), self.max_pages)
            table[i] = 0
            table[i, :used] = pages[:used]
            real.extend(range(row, row + k))
        lens[n:bs] = 0
        slots[n * w : bs * w] = -1
        # ids | positions | slots | seq_lens whole (their rows are bucket-strided), then the
        # page table rows of this bucket.
        self._flat[: self._head].copy_(host[: self._head], non_blocking=True)
        end = self._head + bs * self.max_pages
        self._flat[self._head : end].copy_(host[self._head : end], non_blocking=True)
        return real

    def replay(self, bs: int, seq_lens: list[int]) -> Any:
        """Bucket `bs` over the filled buffers: its graph's outputs (graph memory, valid until
        the next replay), or on a CPU an eager run with the host lengths `seq_lens`."""
        self.num_replays += 1
        if self.replays:
            self._graphs[bs].replay()
            return self._out[bs]
        return self._forward(bs, seq_lens)

    def rows(self, real: list[int]) -> torch.Tensor:
        """Row indices on the device."""
        return torch.tensor(real, dtype=torch.int64).to(self._flat.device, non_blocking=True)
