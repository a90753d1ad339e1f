"""CUDA graphs for steps that carry prompt tokens: the whole forward, attention included.

Why: piecewise graphs (worker/piecewise.py) replay everything but attention, which still runs
eagerly between the pieces: per layer a store, the decode and prefill launches and their index
ops, 36 times a step on an 8B model. On the H200 a step with prompt tokens took ~12 ms more
than a decode step whether it ran 1-64 prompt tokens or 257-512 (bench/served.py's step times
by prompt tokens, docs/benchmarks.md): host time, not compute, and every decode row riding in
the step paid it as inter-token latency.

How: a mixed step's attention reads device tensors of fixed shape only (`ForwardBatch.
mixed_rows`, worker/model/triton_attention.py `mixed_rows_attention`), so the whole forward is
captured once per token bucket (`mixed_buckets`, up to chunked_prefill_size):
- the one-token rows: D = min(bucket, max_num_seqs) of them through the paged decode kernel
  (row in q, context length, page table; padding rows have context 0 and land in a spare row);
- the multi-token requests: R = min(bucket / 2, max_prefills) of them through one paged-prefill
  launch whose grid covers the whole bucket (first and one-past-last row, context, page table;
  padding requests have no rows, and a block past its request's rows stores nothing).
Inputs live in one flat int64 buffer (ids | positions | slots | logits rows | decode rows and
lengths | prefill rows and lengths, then the two page tables); a step writes it through numpy
views of a pinned host copy, copies what it used and replays the bucket. A step that does not
fit (more multi-token requests than R, one past the prefill kernel's cells, drafts) takes the
piecewise graphs instead.

Only where piecewise graphs run (dense single-rank models, worker/fast_paths.py), and only
behind the Triton backend. On a CPU nothing is captured: `run` runs the same static batch
eagerly (the tests check the fill and the split that way, under Triton's interpreter).
"""

from __future__ import annotations

from typing import Any

import torch

from worker.batch import ForwardBatch, MixedRows
from worker.cuda_graphs import capture_buckets
from worker.kv_cache import KVCache
from worker.model import CausalLM
from worker.model.triton_attention import PREFILL_KERNEL_CELLS
from worker.step import ScheduledChunk

MAX_PREFILLS = 8  # multi-token requests one captured step takes (its prefill grid's first axis)
FINE_STEP = 64  # buckets double up to 128, then grow by this many tokens


def mixed_buckets(max_tokens: int) -> list[int]:
    """Padded token counts: 16, 32, 64, 128, then every FINE_STEP tokens, then max_tokens. A
    mixed step's GPU time grows with its rows (a 290-token step padded to 512 would pay for
    512), so the large buckets are finer than powers of two."""
    sizes, b = [], 16
    while b < max_tokens:
        sizes.append(b)
        b = b * 2 if b < 128 else b + FINE_STEP
    return [*sizes, max_tokens]


class MixedGraphs:
    def __init__(self, model: CausalLM, kv: KVCache, max_tokens: int, max_num_seqs: int,
                 max_model_len: int, max_prefills: int = MAX_PREFILLS) -> None:
        self.model = model
        self.kv = kv
        self.replays = kv.data.is_cuda  # False on a CPU: each step runs eagerly (module doc)
        self.page_size = kv.shape.page_size
        self.buckets = mixed_buckets(max_tokens)
        t = self.max_tokens = self.buckets[-1]
        d = self.max_decode = min(t, max_num_seqs)
        r = self.max_prefills = max(1, min(t // 2, max_prefills))
        w = self.max_pages = -(-max_model_len // self.page_size)
        # ids | positions | slots | logits rows | PENDING sources [T], decode q rows | out rows |
        # lengths [D], prefill starts | ends | lengths [R], then the two page tables.
        self._head = 5 * t + 3 * d + 3 * r
        self._tables = (self._head, self._head + d * w, self._head + (d + r) * w)
        device = kv.data.device
        self._flat = torch.zeros(self._tables[2], dtype=torch.int64, device=device)
        self._host = torch.zeros(self._tables[2], dtype=torch.int64, pin_memory=self.replays)
        self._copied: torch.cuda.Event | None = None  # the last host → device copy
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._hidden: dict[int, torch.Tensor] = {}  # bucket → static hidden [bucket, H]
        self.num_replays = 0

    def _views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views of a flat buffer (the device one or the host one)."""
        t, d, r, w = self.max_tokens, self.max_decode, self.max_prefills, self.max_pages
        head, dec_end, end = self._tables
        ids, pos, slots, logit_rows, src = flat[: 5 * t].view(5, t)
        dq, do, dl = flat[5 * t : 5 * t + 3 * d].view(3, d)
        ps, pe, pl = flat[5 * t + 3 * d : head].view(3, r)
        return {"ids": ids, "pos": pos, "slots": slots, "logit_rows": logit_rows, "src": src,
                "dq": dq,
                "do": do, "dl": dl, "ps": ps, "pe": pe, "pl": pl,
                "dt": flat[head:dec_end].view(d, w), "pt": flat[dec_end:end].view(r, w)}

    def _sizes(self, bs: int) -> tuple[int, int]:
        """(decode rows, prefill requests) of bucket `bs`."""
        return min(bs, self.max_decode), max(1, min(bs // 2, self.max_prefills))

    def _batch(self, bs: int) -> ForwardBatch:
        """The static batch of bucket `bs`: token inputs and the attention rows; the request
        fields are placeholders (the mixed-rows attention reads none)."""
        v, (d, r) = self._views(self._flat), self._sizes(bs)
        rows = MixedRows(
            decode_q_rows=v["dq"][:d], decode_out_rows=v["do"][:d], decode_seq_lens=v["dl"][:d],
            decode_page_table=v["dt"][:d], prefill_start=v["ps"][:r], prefill_end=v["pe"][:r],
            prefill_seq_lens=v["pl"][:r], prefill_page_table=v["pt"][:r])
        return ForwardBatch(
            input_ids=v["ids"][:bs], positions=v["pos"][:bs], query_start=v["pe"][:2],
            seq_lens=v["pl"][:1], page_table=v["pt"][:1], slot_mapping=v["slots"][:bs],
            logits_indices=v["logit_rows"][:0], query_start_list=[0, bs], seq_lens_list=[bs],
            mixed_rows=rows)

    def _forward(self, bs: int) -> torch.Tensor:
        return self.model(self._batch(bs), self.kv)  # [bs, hidden]

    @torch.inference_mode()
    def capture(self) -> None:
        """Every bucket with padding inputs only (no page is written: slot -1, no context, padding
        decode rows into row 0), largest first."""
        self._flat.zero_()
        self._views(self._flat)["slots"].fill_(-1)
        if self.replays:
            self._graphs, self._hidden = capture_buckets(self.buckets, self._forward)

    def bucket_for(self, chunks: list[ScheduledChunk]) -> int | None:
        """The bucket a step takes, or None when it does not fit a captured one."""
        tokens = sum(c.num_tokens for c in chunks)
        bs = next((b for b in self.buckets if b >= tokens), None)
        if bs is None or any(c.drafts for c in chunks):
            return None
        long = [c for c in chunks if c.num_tokens > 1]
        if len(long) > self._sizes(bs)[1] or any(
                c.num_tokens * (c.start + c.num_tokens) > PREFILL_KERNEL_CELLS for c in long):
            return None
        return bs

    def run(self, chunks: list[ScheduledChunk], bs: int, prev_tokens: torch.Tensor | None = None,
            src_rows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay bucket `bs` for `chunks` → (hidden [T, H], the logits rows [N] of the chunks
        that sample, in order): views of graph memory, valid until the next replay.

        An overlapped step: `src_rows[i] >= 0` means token i's input is `prev_tokens[src_rows[i]]`
        (runner.py `pending_rows`), patched on the device before the replay."""
        if self._copied is not None:
            self._copied.synchronize()  # the host buffer's last copy has left it
        t, n = self.fill(chunks, bs, src_rows)
        self.num_replays += 1
        if prev_tokens is not None:
            v = self._views(self._flat)
            ids, src = v["ids"][:t], v["src"][:t]
            ids.copy_(torch.where(src >= 0, prev_tokens[src.clamp(min=0)], ids))
        if self.replays:
            self._copied = torch.cuda.Event()
            self._copied.record()
            self._graphs[bs].replay()
            hidden = self._hidden[bs]
        else:
            hidden = self._forward(bs)
        return hidden[:t], self._views(self._flat)["logit_rows"][:n]

    def fill(self, chunks: list[ScheduledChunk], bs: int,
             src_rows: list[int] | None = None) -> tuple[int, int]:
        """Write bucket `bs`'s inputs for `chunks` (a PENDING input as 0 until patched) and copy
        them to the device; returns (real tokens, sampling chunks)."""
        ps = self.page_size
        # numpy views of the pinned host buffer (worker/cuda_graphs.py DecodeGraphs.fill)
        v = {k: x.numpy() for k, x in self._views(self._host).items()}
        t = d = r = s = 0
        for chunk in chunks:
            table, start, n = chunk.request.page_table, chunk.start, chunk.num_tokens
            end = start + n
            v["ids"][t : t + n] = [max(i, 0) for i in chunk.input_ids()]
            v["pos"][t : t + n] = range(start, end)
            # A replayed token (below full_from) has its KV in a shared cached page already.
            v["slots"][t : t + n] = [table[p // ps] * ps + p % ps if p >= chunk.full_from else -1
                                     for p in range(start, end)]
            used = -(-end // ps)  # the pages its context reaches (the kernels read no more)
            if n == 1:
                v["dq"][d], v["do"][d], v["dl"][d] = t, t, end
                v["dt"][d, :used] = table[:used]
                d += 1
            else:
                v["ps"][r], v["pe"][r], v["pl"][r] = t, t + n, end
                v["pt"][r, :used] = table[:used]
                r += 1
            t += n
            if chunk.sample:
                v["logit_rows"][s] = t - 1
                s += 1
        v["src"][:t] = src_rows if src_rows is not None else -1
        self._fill_padding(v, t, d, r, bs)
        head, dec, _ = self._tables
        w = self.max_pages
        for lo, hi in ((0, head), (head, head + d * w), (dec, dec + r * w)):
            if hi > lo:
                self._flat[lo:hi].copy_(self._host[lo:hi], non_blocking=True)
        return t, s

    def _fill_padding(self, v: dict[str, Any], t: int, d: int, r: int, bs: int) -> None:
        """Bucket `bs`'s rows past the real ones: tokens stored nowhere, decode rows with no
        context (written to the spare row bs), prefill requests with no rows."""
        nd, nr = self._sizes(bs)
        v["ids"][t:bs] = 0
        v["pos"][t:bs] = 0
        v["slots"][t:bs] = -1
        v["dq"][d:nd], v["do"][d:nd], v["dl"][d:nd] = 0, bs, 0
        v["ps"][r:nr], v["pe"][r:nr], v["pl"][r:nr] = 0, 0, 0
