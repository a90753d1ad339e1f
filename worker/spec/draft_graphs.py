"""CUDA graphs for a model drafter's draft steps (B requests x one token) and its catch-up.

`ModelDrafter.draft` runs k - 1 (eagle / mtp) or k (draft model) head steps per verify, each a
single-token step over every drafting request. Eagerly a step is a few dozen launches from
Python plus a handful of small host → device copies (bench/spec_gpu.py on an H200: ~1.4 ms a
step at batch 1 for a head of the 8B shape, whose weights take ~0.4 ms to read), so it is
captured once per padded batch-size bucket (worker/cuda_graphs.py's buckets) and replayed:

- Static device buffers: ids | positions | slots | seq_lens in one flat int64 buffer, then the
  page table (one pinned host → device copy per step), and the head's input features
  [Bmax, H] (eagle / mtp: the previous step's features, copied in on the device).
- Padding rows (past B in the bucket): seq_len 0 and slot -1, as the decode graphs' padding
  rows: their KV is never written and their attention yields zeros.
- `run(tokens, positions, tables, hidden)` returns the features and logits of the real rows
  (views into graph memory, valid until the next replay: the drafter reads them before its
  next step).

Which heads: those whose single-token step reads no host value (`DraftHead.graph_safe`):
the EAGLE head and the dense MTP module (one decoder layer of a dense family) and a draft
model, with a rope that does not depend on the request's length. Eagle's first draft (the LM
head alone) stays eager. `CatchUpGraphs` does the same for the catch-up after a decode or
verify step (up to k + 1 positions per request, padded as the verify graphs pad); a prompt
chunk's catch-up runs eagerly.

On a CPU the same object runs each step eagerly over the same static buffers (nothing to
capture): what the CPU tests use to check the buffers against the plain step.
"""

from __future__ import annotations

import torch

from worker.batch import ForwardBatch
from worker.cuda_graphs import graph_buckets
from worker.kv_cache import KVCache
from worker.spec.heads import DraftHead


class DraftGraphs:
    def __init__(self, head: DraftHead, kv: KVCache, max_num_seqs: int, max_model_len: int,
                 num_speculative_tokens: int, hidden_size: int, dtype: torch.dtype) -> None:
        self.head, self.kv = head, kv
        self.replays = kv.data.is_cuda  # False on a CPU: each step runs eagerly (module doc)
        self.page_size = kv.shape.page_size
        self.buckets = graph_buckets(max_num_seqs)
        self.max_bs = self.buckets[-1]
        # Draft positions reach k past the verified ones.
        self.max_pages = -(-(max_model_len + num_speculative_tokens) // self.page_size)
        device = kv.data.device
        b = self.max_bs
        self._head = 4 * b  # ids | positions | slots | seq_lens, then the page table
        size = self._head + b * self.max_pages
        self._flat = torch.zeros(size, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.slots, self.seq_lens = self._flat[: self._head].view(
            4, b)
        self.page_table = self._flat[self._head :].view(b, self.max_pages)
        self.query_start = torch.arange(b + 1, dtype=torch.int64, device=device)  # [Bmax+1]
        self.hidden = (torch.zeros(b, hidden_size, dtype=dtype, device=device)
                       if head.needs_hidden else None)  # [Bmax, H]
        self._host = torch.zeros(size, dtype=torch.int64, pin_memory=self.replays)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # bucket → (feats, logits)
        self.num_replays = 0

    def _batch(self, bs: int) -> ForwardBatch:
        """The static batch of one bucket; on CUDA the host lists are placeholders (the decode
        kernel reads none), on a CPU the reference backend reads them, so they are real."""
        lens = [1] * bs if self.replays else self.seq_lens[:bs].tolist()
        return ForwardBatch(
            input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            query_start=self.query_start[: bs + 1], seq_lens=self.seq_lens[:bs],
            page_table=self.page_table[:bs], slot_mapping=self.slots[:bs],
            logits_indices=self.query_start[:bs], query_start_list=list(range(bs + 1)),
            seq_lens_list=lens,
        )

    def _forward(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.hidden[:bs] if self.hidden is not None else None
        feats = self.head(self._batch(bs), self.kv, hidden)  # [bs, H]
        return feats, self.head.compute_logits(feats)  # [bs, V] fp32

    def bucket_for(self, batch_size: int) -> int | None:
        for bs in self.buckets:
            if bs >= batch_size:
                return bs
        return None

    @torch.inference_mode()
    def capture(self) -> None:
        """Every row padding while capturing (seq_len 0, slot -1): no page is written."""
        self.slots.fill_(-1)
        self.seq_lens.zero_()
        if not self.replays:
            return
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

    def _fill(self, tokens: list[int], positions: list[int], tables: list[list[int]],
              bs: int) -> None:
        """Write the rows (padding past them) into the static buffers of bucket `bs`."""
        n, ps = len(tokens), self.page_size
        host = self._host
        ids, pos, slots, lens = host[: self._head].view(4, self.max_bs)
        table = host[self._head :].view(self.max_bs, self.max_pages)
        for i, (token, p, pages) in enumerate(zip(tokens, positions, tables, strict=True)):
            ids[i], pos[i], lens[i] = token, p, p + 1
            slots[i] = pages[p // ps] * ps + p % ps
            used = p // ps + 1
            table[i, :used] = torch.as_tensor(pages[:used])
        ids[n:bs], pos[n:bs], lens[n:bs], slots[n:bs] = 0, 0, 0, -1
        end = self._head + bs * self.max_pages  # the page-table rows of this bucket
        self._flat[: self._head].copy_(host[: self._head], non_blocking=True)
        self._flat[self._head : end].copy_(host[self._head : end], non_blocking=True)

    @torch.inference_mode()
    def run(self, tokens: list[int], positions: list[int], tables: list[list[int]],
            hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step: request i feeds tokens[i] at positions[i] over its page table
        tables[i] → (features [n, H], logits [n, V] fp32) of the real rows. `hidden` [n, H]:
        the head's inputs (eagle / mtp), on the device."""
        n = len(tokens)
        bs = self.bucket_for(n)
        assert bs is not None, f"no draft graph for {n} requests"
        self._fill(tokens, positions, tables, bs)
        if self.hidden is not None:
            assert hidden is not None, "an eagle / mtp head is fed features"
            self.hidden[:n].copy_(hidden)
        self.num_replays += 1
        if self.replays:
            self._graphs[bs].replay()
            feats, logits = self._out[bs]
        else:
            feats, logits = self._forward(bs)
        return feats[:n], logits[:n]


class CatchUpGraphs:
    """CUDA graphs for the catch-up after a decode or verify step: B requests x up to
    w = k + 1 positions each (the verified token and the accepted drafts), laid out as the
    verify graphs lay theirs (worker/verify_graphs.py): request i owns rows [i*w, (i+1)*w),
    its real positions first, then padding rows (positions continued, slot -1: never stored;
    only they attend past the real rows). Attention is the paged kernel over device tensors
    (`ForwardBatch.uniform_query_len` = w), so FP8 KV pages, which it does not read, stay
    eager. `run` returns each request's feature at its last real position (eagle / mtp: what
    the next draft starts from)."""

    def __init__(self, head: DraftHead, kv: KVCache, max_num_seqs: int, max_model_len: int,
                 num_speculative_tokens: int, hidden_size: int, dtype: torch.dtype) -> None:
        self.head, self.kv = head, kv
        self.replays = kv.data.is_cuda
        self.page_size = kv.shape.page_size
        self.width = w = num_speculative_tokens + 1
        self.max_model_len = max_model_len
        self.buckets = graph_buckets(max_num_seqs)
        self.max_bs = b = self.buckets[-1]
        self.max_pages = -(-(max_model_len + w) // self.page_size)
        device = kv.data.device
        t = b * w
        self._head = 3 * t + b  # ids | positions | slots (one per row), seq_lens, page table
        size = self._head + b * self.max_pages
        self._flat = torch.zeros(size, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.slots = self._flat[: 3 * t].view(3, t)
        self.seq_lens = self._flat[3 * t : self._head]
        self.page_table = self._flat[self._head :].view(b, self.max_pages)
        self.query_start = torch.arange(0, (b + 1) * w, w, dtype=torch.int64, device=device)
        self.hidden = (torch.zeros(t, hidden_size, dtype=dtype, device=device)
                       if head.needs_hidden else None)  # [Bmax*w, H]
        self._host = torch.zeros(size, dtype=torch.int64, pin_memory=self.replays)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._out: dict[int, torch.Tensor] = {}  # bucket → features [bucket*w, H]
        self.num_replays = 0

    def _batch(self, bs: int, seq_lens: list[int] | None = None) -> ForwardBatch:
        t, w = bs * self.width, self.width
        empty = self.query_start[:0]
        return ForwardBatch(
            input_ids=self.input_ids[:t], positions=self.positions[:t],
            query_start=self.query_start[: bs + 1], seq_lens=self.seq_lens[:bs],
            page_table=self.page_table[:bs], slot_mapping=self.slots[:t], logits_indices=empty,
            # Placeholders for the CUDA kernel (it reads none); exact on the CPU.
            query_start_list=list(range(0, (bs + 1) * w, w)),
            seq_lens_list=seq_lens if seq_lens is not None else [w] * bs,
            uniform_query_len=w,
        )

    def _forward(self, bs: int, seq_lens: list[int] | None = None) -> torch.Tensor:
        hidden = self.hidden[: bs * self.width] if self.hidden is not None else None
        return self.head(self._batch(bs, seq_lens), self.kv, hidden)  # [bs*w, H]

    def bucket_for(self, batch_size: int) -> int | None:
        for bs in self.buckets:
            if bs >= batch_size:
                return bs
        return None

    @torch.inference_mode()
    def capture(self) -> None:
        self.slots.fill_(-1)
        self.seq_lens.zero_()
        if not self.replays:
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bs in self.buckets:
                for _ in range(2):
                    self._forward(bs)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for bs in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._out[bs] = self._forward(bs)
            self._graphs[bs] = graph
        torch.cuda.synchronize()

    @torch.inference_mode()
    def run(self, starts: list[int], tokens: list[list[int]], tables: list[list[int]],
            hidden: torch.Tensor | None) -> torch.Tensor:
        """Request i feeds tokens[i] (1..w of them) from position starts[i] over its page table
        tables[i]; `hidden` [sum of lengths, H]: the head's inputs in that order (eagle /
        mtp). → features [n, H] at each request's last real position."""
        n, w, ps = len(starts), self.width, self.page_size
        bs = self.bucket_for(n) if self.replays else n  # the CPU reference reads host lengths
        assert bs is not None, f"no catch-up graph for {n} requests"
        host = self._host
        t = self.max_bs * w
        ids, pos, slots = host[: 3 * t].view(3, t)
        lens = host[3 * t : self._head]
        table = host[self._head :].view(self.max_bs, self.max_pages)
        rows: list[int] = []
        last: list[int] = []
        for i, (start, toks, pages) in enumerate(zip(starts, tokens, tables, strict=True)):
            k, row = len(toks), i * w
            ids[row : row + w] = 0
            ids[row : row + k] = torch.as_tensor(toks)
            pos[row : row + w] = torch.arange(start, start + w).clamp(max=self.max_model_len - 1)
            slots[row : row + w] = -1
            slots[row : row + k] = torch.as_tensor(
                [pages[p // ps] * ps + p % ps for p in range(start, start + k)])
            lens[i] = start + w
            used = min(len(pages), self.max_pages)
            table[i].zero_()
            table[i, :used] = torch.as_tensor(pages[:used])
            rows.extend(range(row, row + k))
            last.append(row + k - 1)
        lens[n:bs] = 0
        slots[n * w : bs * w] = -1
        self._flat[: self._head].copy_(host[: self._head], non_blocking=True)
        end = self._head + bs * self.max_pages
        self._flat[self._head : end].copy_(host[self._head : end], non_blocking=True)
        device = self._flat.device
        if self.hidden is not None:
            assert hidden is not None, "an eagle / mtp head catches up on the target's states"
            dst = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
            self.hidden.index_copy_(0, dst, hidden.to(self.hidden.dtype))
        self.num_replays += 1
        if self.replays:
            self._graphs[bs].replay()
            feats = self._out[bs]
        else:
            feats = self._forward(bs, [s + w for s in starts])
        return feats.index_select(0, torch.tensor(last, dtype=torch.int64).to(device))
