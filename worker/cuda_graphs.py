"""CUDA graphs for pure-decode steps: one graph per padded batch-size bucket.

Why: a decode step of an 8B model launches ~15 kernels per layer (~550 in all) for a few
milliseconds of GPU work; launched one by one from Python, the launch gaps dominate at small
batch. A graph replays the whole forward (+ logits) with one launch.

How:
1. `DecodeGraphs(model, kv, max_num_seqs, max_model_len)` owns static device buffers sized
   for the largest bucket. All integer inputs live in ONE flat int64 buffer
   (ids | positions | seq_lens | slots | source rows | page table), so a step is one pinned
   host → device copy of the used prefix.
2. `capture()` (at start-up, after the engine's warm-up) runs each bucket twice eagerly on a
   side stream (Triton compiles, allocator settles), then captures largest first into one
   shared memory pool. During capture every row is padding (seq_len 0, slot -1), so the
   KV pool is never written.
3. `run(chunks)` fills the pinned buffer (padding rows: seq_len 0 → the decode kernel yields
   zeros; slot -1 → the store kernel skips them), copies it, replays the bucket's graph and
   returns logits [B, vocab] (a view into graph memory, valid until the next replay).
   Overlapped decode (`prev_tokens`): an input the host does not know yet (PENDING) is read on
   the device from the previous step's sampled tokens, by its row there ("source rows").

Two pinned buffers take turns, each with an event on its copy: with overlap the host fills
step N+1's inputs while step N's copy may still be queued, so it writes the other buffer, and
waits (rarely) only for the copy that last read the buffer it is about to fill.

Multi-rank workers (TP, attention DP): every rank captures the same buckets in the same order,
since the collectives inside (all-reduce per block half, the vocab gather, the MoE all-to-all)
are captured on every rank. Replay bypasses `forward`, so the step's inputs travel outside the
graph: a model that is a `StepMirror` (the TP leader's, worker/tp_runner.py) is told at capture
(the followers capture too) and before each replay (the flat input prefix goes to every rank,
which replays the same bucket); DP steps go through worker/dp_runner.py with `fill`/`load`.
MoE blocks take their static-shape path inside (worker/model/moe.py `graph_shapes`).

On a CPU the same object runs each "replay" as an eager forward over the same static buffers
(there is no graph to capture): what CPU tests use to check the multi-rank protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar, runtime_checkable

import torch

from worker.batch import ForwardBatch
from worker.kv_cache import KVCache
from worker.model import CausalLM
from worker.model.moe import graph_shapes
from worker.step import ScheduledChunk

T = TypeVar("T")


@runtime_checkable
class StepMirror(Protocol):
    """A model whose steps other ranks mirror (the TP leader's): graphs capture and replay its
    `local_model`, and tell the other ranks first."""

    @property
    def local_model(self) -> CausalLM: ...

    def mirror_capture(self, max_num_seqs: int, max_model_len: int) -> None:
        """The other ranks build their DecodeGraphs and capture, in step with this rank."""

    def mirror_replay(self, inputs: torch.Tensor) -> None:
        """The other ranks load `inputs` (the flat input prefix) and replay its bucket."""


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, then multiples of 8 up to max_num_seqs (included)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


def capture_buckets(buckets: list[int], forward: Callable[[int], T],
                    ) -> tuple[dict[int, torch.cuda.CUDAGraph], dict[int, T]]:
    """One graph per bucket of `forward(bs)`: each bucket run twice on a side stream first
    (Triton compiles, the allocator settles), then captured largest first into one memory pool
    (smaller graphs reuse its blocks). Returns the graphs and what each capture returned (its
    static outputs)."""
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for bs in buckets:
            for _ in range(2):
                forward(bs)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    outs: dict[int, T] = {}
    for bs in reversed(buckets):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outs[bs] = forward(bs)
        graphs[bs] = graph
    torch.cuda.synchronize()
    return graphs, outs


class DecodeGraphs:
    def __init__(self, model: CausalLM, kv: KVCache, max_num_seqs: int, max_model_len: int) -> None:
        self._mirror = model if isinstance(model, StepMirror) else None
        self.model = model.local_model if isinstance(model, StepMirror) else model
        self.kv = kv
        self.replays = kv.data.is_cuda  # False on a CPU: each step runs eagerly (module doc)
        self.page_size = kv.shape.page_size
        self.buckets = graph_buckets(max_num_seqs)
        self.max_bs = self.buckets[-1]
        self.max_pages = -(-max_model_len // self.page_size)
        device = kv.data.device
        b, w = self.max_bs, self.max_pages
        self._head = 5 * b  # ids | positions | seq_lens | slots | source rows, then the page table
        size = self._head + b * w
        self._flat = torch.zeros(size, dtype=torch.int64, device=device)
        head = self._flat[: self._head].view(5, b)
        self.input_ids, self.positions, self.seq_lens, self.slots, self.src_rows = head
        self.page_table = self._flat[self._head :].view(b, w)  # [Bmax, max_pages]
        self.query_start = torch.arange(b + 1, dtype=torch.int64, device=device)  # [Bmax+1]
        self._hosts = [torch.zeros(size, dtype=torch.int64, pin_memory=self.replays)
                       for _ in range(2)]
        self._copied: list[torch.cuda.Event | None] = [None, None]  # each host buffer's last copy
        self._turn = 0
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._ready: set[int] = set()  # buckets captured (on a CPU: every bucket, no graph)
        self._logits: dict[int, torch.Tensor] = {}  # bucket → static logits [bucket, vocab] fp32
        self._hidden: dict[int, torch.Tensor] = {}  # bucket → static hidden [bucket, hidden]
        self.num_replays = 0
        self._last_bs = 0  # the bucket replayed last (for `hidden`)

    def used_len(self, bs: int) -> int:
        """Length of the flat input prefix of bucket `bs` (the rows past it are not copied)."""
        return self._head + bs * self.max_pages

    def bucket_of_len(self, used_len: int) -> int:
        """The bucket whose input prefix is `used_len` long (a follower receives only that)."""
        bs, rest = divmod(used_len - self._head, self.max_pages)
        assert rest == 0 and bs in self._ready, f"no graph for an input prefix of {used_len}"
        return bs

    def inputs(self, bs: int) -> torch.Tensor:
        """The device input prefix of bucket `bs`: what a step fills, copies or receives."""
        return self._flat[: self.used_len(bs)]

    def _batch(self, bs: int) -> ForwardBatch:
        """The static ForwardBatch of one bucket. On CUDA the host lists are placeholders (the
        decode kernels read none); the CPU reference reads them, so there they are real."""
        lens = self.seq_lens[:bs].tolist() if not self.replays else [1] * bs
        return ForwardBatch(
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            query_start=self.query_start[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            page_table=self.page_table[:bs],
            slot_mapping=self.slots[:bs],
            logits_indices=self.query_start[:bs],
            query_start_list=list(range(bs + 1)),
            seq_lens_list=lens,
        )

    def _forward(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model(self._batch(bs), self.kv)  # [bs, hidden]
        return hidden, self.model.compute_logits(hidden)  # [bs, vocab] fp32

    @torch.inference_mode()
    def capture(self) -> None:
        if self._mirror is not None:  # first: the other ranks capture beside this one
            self._mirror.mirror_capture(self.max_bs, self.max_pages * self.page_size)
        self.slots.fill_(-1)
        self.seq_lens.zero_()
        if not self.replays:  # a CPU: nothing to capture, steps run eagerly
            self._ready.update(self.buckets)
            return
        with graph_shapes(self.model):
            self._capture()

    def _capture(self) -> None:
        self._graphs, outs = capture_buckets(self.buckets, self._forward)
        for bs, (hidden, logits) in outs.items():
            self._hidden[bs], self._logits[bs] = hidden, logits
        self._ready.update(self.buckets)

    def bucket_for(self, batch_size: int) -> int | None:
        for bs in self.buckets:
            if bs >= batch_size:
                return bs if bs in self._ready else None
        return None

    def replay(self, bs: int) -> torch.Tensor:
        """Run bucket `bs` over the inputs already in place → logits [bs, vocab] (graph memory,
        valid until the next replay)."""
        self.num_replays += 1
        self._last_bs = bs
        if self.replays:
            self._graphs[bs].replay()
        else:
            with graph_shapes(self.model):
                self._hidden[bs], self._logits[bs] = self._forward(bs)
        return self._logits[bs]

    def load(self, inputs: torch.Tensor) -> None:
        """Copy an input prefix (another rank filled it) into the static buffer."""
        self._flat[: inputs.numel()].copy_(inputs)

    def run(self, chunks: list[ScheduledChunk], prev_tokens: torch.Tensor | None = None,
            src_rows: list[int] | None = None) -> torch.Tensor:
        """Replay for a pure-decode plan (every chunk one token, sampled) → logits [B, vocab].

        Overlapped decode: `src_rows[i] >= 0` means chunk i's input is `prev_tokens[src_rows[i]]`.
        """
        n = len(chunks)
        bs = self.bucket_for(n)
        assert bs is not None, f"no graph for batch size {n}"
        host = self._hosts[self._turn]
        copied = self._copied[self._turn]
        if copied is not None:
            copied.synchronize()  # the copy that last read this buffer (two steps ago) is done
        used_len = self.fill(host, chunks, bs, src_rows)
        # Rows are max_pages wide; copy only the rows of this bucket.
        self._flat[:used_len].copy_(host[:used_len], non_blocking=True)
        if self.replays:
            event = torch.cuda.Event()
            event.record()
            self._copied[self._turn] = event
        self._turn = 1 - self._turn
        if self._mirror is not None:  # the followers replay the same bucket on these inputs
            assert prev_tokens is None, "multi-rank workers do not overlap decode"
            self._mirror.mirror_replay(self._flat[:used_len])
        if prev_tokens is not None:
            src = self.src_rows[:n]
            ids_dev = self.input_ids[:n]
            ids_dev.copy_(torch.where(src >= 0, prev_tokens[src.clamp(min=0)], ids_dev))
        return self.replay(bs)[:n]

    def fill(self, host: torch.Tensor, chunks: list[ScheduledChunk], bs: int,
             src_rows: list[int] | None = None) -> int:
        """Write bucket `bs`'s inputs for `chunks` (padding rows past them) into a flat host
        buffer laid out like the static one; returns the prefix length to copy."""
        n, ps = len(chunks), self.page_size
        # numpy views of the (pinned) host buffer: an element store there costs ~0.1 µs against
        # ~1.5 µs through a tensor's __setitem__, and this loop runs for every row of every step
        flat = host.numpy()
        ids, pos, lens, slots, rows = flat[: self._head].reshape(5, self.max_bs)
        table_rows = flat[self._head : self.used_len(bs)].reshape(bs, self.max_pages)
        for i, chunk in enumerate(chunks):
            req, p = chunk.request, chunk.start
            table = req.page_table
            out = req.output_token_ids
            prompt = req.prompt_token_ids
            # A PENDING input (-1) is patched on the device below; the host buffer keeps a
            # valid id, because a later, smaller batch replays its rows as padding.
            ids[i] = prompt[p] if p < len(prompt) else max(out[p - len(prompt)], 0)
            pos[i] = p
            lens[i] = p + 1
            slots[i] = table[p // ps] * ps + p % ps
            used = p // ps + 1
            table_rows[i, :used] = table[:used]
        lens[n:bs] = 0  # padding rows: attend to nothing
        slots[n:bs] = -1  # padding rows: write nowhere
        rows[:n] = src_rows if src_rows is not None else -1
        return self.used_len(bs)

    def hidden(self, n: int) -> torch.Tensor:
        """The last replay's final hidden states [n, hidden] (a speculative drafter's input;
        a view into graph memory, valid until the next replay)."""
        return self._hidden[self._last_bs][:n]
