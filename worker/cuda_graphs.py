"""CUDA graphs for pure-decode steps: one graph per padded batch-size bucket.

Why: a decode step of an 8B model launches ~15 kernels per layer (~550 in all) for a few
milliseconds of GPU work; launched one by one from Python, the launch gaps dominate at small
batch. A graph replays the whole forward (+ logits) with one launch.

How:
1. `DecodeGraphs(model, kv, max_num_seqs, max_model_len)` owns static device buffers sized
   for the largest bucket. All integer inputs live in ONE flat int64 buffer
   (ids | positions | seq_lens | slots | page table), so a step is one pinned host → device
   copy of the used prefix.
2. `capture()` (at start-up, after the engine's warm-up) runs each bucket twice eagerly on a
   side stream (Triton compiles, allocator settles), then captures largest first into one
   shared memory pool. During capture every row is padding (seq_len 0, slot -1), so the
   KV pool is never written.
3. `run(chunks)` fills the pinned buffer (padding rows: seq_len 0 → the decode kernel yields
   zeros; slot -1 → the store kernel skips them), copies it, replays the bucket's graph and
   returns logits [B, vocab] (a view into graph memory, valid until the next replay).

Buffer reuse is safe without events because each step ends with the sampler's device → host
copy of the chosen tokens, which waits for the replay (and so for the copy before it).
"""

from __future__ import annotations

import torch

from worker.batch import ForwardBatch
from worker.kv_cache import KVCache
from worker.model import CausalLM
from worker.scheduler import ScheduledChunk


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, then multiples of 8 up to max_num_seqs (included)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphs:
    def __init__(self, model: CausalLM, kv: KVCache, max_num_seqs: int, max_model_len: int) -> None:
        self.model = model
        self.kv = kv
        self.page_size = kv.shape.page_size
        self.buckets = graph_buckets(max_num_seqs)
        self.max_bs = self.buckets[-1]
        self.max_pages = -(-max_model_len // self.page_size)
        device = kv.data.device
        b, w = self.max_bs, self.max_pages
        self._head = 4 * b  # ids | positions | seq_lens | slots, then the page table
        size = self._head + b * w
        self._flat = torch.zeros(size, dtype=torch.int64, device=device)
        self._host = torch.zeros(size, dtype=torch.int64, pin_memory=True)
        self.input_ids = self._flat[0:b]  # [Bmax]
        self.positions = self._flat[b : 2 * b]  # [Bmax]
        self.seq_lens = self._flat[2 * b : 3 * b]  # [Bmax]
        self.slots = self._flat[3 * b : 4 * b]  # [Bmax]
        self.page_table = self._flat[self._head :].view(b, w)  # [Bmax, max_pages]
        self.query_start = torch.arange(b + 1, dtype=torch.int64, device=device)  # [Bmax+1]
        self._host_ids = self._host[0:b]
        self._host_pos = self._host[b : 2 * b]
        self._host_lens = self._host[2 * b : 3 * b]
        self._host_slots = self._host[3 * b : 4 * b]
        self._host_table = self._host[self._head :].view(b, w)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}  # bucket → static logits [bucket, vocab] fp32
        self.num_replays = 0

    def _batch(self, bs: int) -> ForwardBatch:
        """The static ForwardBatch of one bucket (host lists are placeholders: decode reads none)."""
        return ForwardBatch(
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            query_start=self.query_start[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            page_table=self.page_table[:bs],
            slot_mapping=self.slots[:bs],
            logits_indices=self.query_start[:bs],
            query_start_list=list(range(bs + 1)),
            seq_lens_list=[1] * bs,
        )

    def _forward(self, bs: int) -> torch.Tensor:
        hidden = self.model(self._batch(bs), self.kv)  # [bs, hidden]
        return self.model.compute_logits(hidden)  # [bs, vocab] fp32

    @torch.inference_mode()
    def capture(self) -> None:
        self.slots.fill_(-1)
        self.seq_lens.zero_()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bs in self.buckets:
                for _ in range(2):
                    self._forward(bs)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for bs in reversed(self.buckets):  # largest first: smaller graphs reuse its pool blocks
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[bs] = self._forward(bs)
            self._graphs[bs] = graph
        torch.cuda.synchronize()

    def bucket_for(self, batch_size: int) -> int | None:
        for bs in self.buckets:
            if bs >= batch_size:
                return bs if bs in self._graphs else None
        return None

    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Replay for a pure-decode plan (every chunk one token, sampled) → logits [B, vocab]."""
        n = len(chunks)
        bs = self.bucket_for(n)
        assert bs is not None, f"no graph for batch size {n}"
        ps = self.page_size
        ids, pos, lens, slots = self._host_ids, self._host_pos, self._host_lens, self._host_slots
        width = 1
        for i, chunk in enumerate(chunks):
            req, p = chunk.request, chunk.start
            table = req.page_table
            out = req.output_token_ids
            prompt = req.prompt_token_ids
            ids[i] = prompt[p] if p < len(prompt) else out[p - len(prompt)]
            pos[i] = p
            lens[i] = p + 1
            slots[i] = table[p // ps] * ps + p % ps
            used = p // ps + 1
            self._host_table[i, :used] = torch.as_tensor(table[:used])
            width = max(width, used)
        lens[n:bs] = 0  # padding rows: attend to nothing
        slots[n:bs] = -1  # padding rows: write nowhere
        # Rows are max_pages wide; copy only the rows of this bucket.
        used_len = self._head + bs * self.max_pages
        self._flat[:used_len].copy_(self._host[:used_len], non_blocking=True)
        self._graphs[bs].replay()
        self.num_replays += 1
        return self._logits[bs][:n]
