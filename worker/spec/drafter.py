"""The model drafter (speculative.method draft | eagle | mtp): catch up, then draft.

A head (worker/spec/heads.py) keeps KV in the target's pages, one row per position like the
target, so it must see every position the target computes. Two calls per engine step:

1. `catch_up(plan, hidden, out)` — in `runner.run`, after the target's forward and sampling,
   before the scheduler's update (so no page has been given back yet): for each chunk, the
   positions whose target KV is now valid (a prompt chunk's tokens; a verify's last token and
   its accepted drafts) run through the head with their known inputs, writing its KV there.
   eagle / mtp at position p read x_{p+1} and the target's h_p (the token after p is known by
   then: the next prompt token, or the one just emitted); a draft model reads x_p. The request's
   `DraftState` moves to the end of those positions, with eagle/mtp's last feature.
2. `draft(plan)` — between `schedule` and `run` of the next step, when the scheduler has
   reserved pages for the verify: up to `max_drafts` tokens per decode chunk, one batched
   single-token head step per draft (eagle/mtp: the first draft is the logits of the state's
   feature, the next ones feed the previous draft and the head's own feature; a draft model
   feeds the request's last token, then its drafts). Greedy requests take the argmax; sampling
   requests draw from the head's distribution (the request's knobs applied) and keep it for
   rejection sampling (`chunk.draft_probs`).

Draft steps write the head's KV at positions past the verified ones; the next catch-up
rewrites those that get accepted, with the true inputs. On a one-rank CUDA worker with a dense
head, draft steps and the catch-ups after decode and verify steps replay CUDA graphs
(`enable_cuda_graphs`, worker/spec/draft_graphs.py); the rest runs eagerly. A prefill worker
only catches up: the prompt's head KV goes to decode with the pages, and the last feature with
the first token.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from worker.batch import ForwardBatch
from worker.kv_cache import KVCache
from worker.model.fp8 import is_fp8
from worker.request import DraftState, Request
from worker.spec.counters import SpecCounters
from worker.spec.draft_graphs import CatchUpGraphs, DraftGraphs
from worker.spec.heads import DraftHead
from worker.spec.verify import target_probs
from worker.step import RunOutput, ScheduledChunk, SchedulePlan

# (batch, hidden) -> (features [T, H] | None, logits [N, V] | None). batch None: `hidden` are
# features already, logits of every row. Multi-rank workers broadcast it (worker/spec/tp.py).
HeadRun = Callable[[ForwardBatch | None, torch.Tensor | None],
                   tuple[torch.Tensor | None, torch.Tensor | None]]


def run_head(head: DraftHead, kv: KVCache, batch: ForwardBatch | None,
             hidden: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One head call on this rank (every rank of a multi-rank worker runs the same)."""
    if batch is None:
        assert hidden is not None
        return hidden, head.compute_logits(hidden)
    feats = head(batch, kv, hidden)  # [T, H]
    if not batch.logits_indices.numel():
        return feats, None
    return feats, head.compute_logits(feats[batch.logits_indices])  # [N, V] fp32


@dataclass
class _Row:
    """One request's span of a head batch."""

    request: Request
    start: int  # position of its first input
    tokens: list[int]  # inputs, one per position from start on
    full_from: int = 0  # positions below keep their cached KV (shared pages): not written


def _feature(chunk: ScheduledChunk) -> torch.Tensor:
    state = chunk.request.draft
    assert state is not None and state.feature is not None  # `_ready` checked it
    return state.feature


class ModelDrafter:
    """Drives a draft head over the target's pages (see the module docstring)."""

    def __init__(self, head: DraftHead, kv: KVCache, device: torch.device, dtype: torch.dtype,
                 *, counters: SpecCounters, run: HeadRun | None = None) -> None:
        self.head, self.kv, self.device, self.dtype = head, kv, device, dtype
        self.page_size = kv.shape.page_size
        self.counters = counters  # catch-up time counts as drafting time
        self.run: HeadRun = run or (lambda b, h: run_head(head, kv, b, h))
        self.single_rank = run is None
        self.graphs: DraftGraphs | None = None  # the draft steps' graphs (enable_cuda_graphs)
        self.catch_up_graphs: CatchUpGraphs | None = None

    def enable_cuda_graphs(self, max_num_seqs: int, max_model_len: int,
                           num_speculative_tokens: int, hidden_size: int) -> bool:
        """Capture the draft steps (worker/spec/draft_graphs.py): single-rank workers with a
        head whose steps read no host value. Returns whether it did."""
        if not (self.single_rank and self.head.graph_safe()):
            return False
        args = (self.head, self.kv, max_num_seqs, max_model_len, num_speculative_tokens,
                hidden_size, self.dtype)
        graphs = DraftGraphs(*args)
        graphs.capture()
        self.graphs = graphs
        if not is_fp8(self.kv.data):  # the catch-up's paged kernel reads no K/V scales
            catch_up = CatchUpGraphs(*args)
            catch_up.capture()
            self.catch_up_graphs = catch_up
        return True

    # ---- 1. after the target's forward --------------------------------------------------------
    @torch.inference_mode()
    def catch_up(self, plan: SchedulePlan, hidden: torch.Tensor | None, out: RunOutput) -> None:
        """hidden [T, H]: the target's final hidden states of the plan's tokens, in plan order
        (None for a draft model, which reads none)."""
        t0 = time.perf_counter()
        rows: list[_Row] = []
        hidden_rows: list[int] = []
        offset, sampled = 0, 0
        for chunk in plan.chunks:
            emitted: list[int] = []
            if chunk.sample:
                emitted = [out.token_ids[sampled]]
                if out.more_token_ids is not None:
                    emitted += out.more_token_ids[sampled]
                sampled += 1
            # A verify's valid positions: its last token and the drafts accepted (= emitted).
            valid = len(emitted) if chunk.drafts else chunk.num_tokens
            seq = chunk.request.all_token_ids() + emitted  # every token known after the step
            shift = 1 if self.head.needs_hidden else 0  # eagle/mtp read the token after p
            tokens = seq[chunk.start + shift : chunk.start + shift + valid]
            assert len(tokens) == valid, f"{chunk.request.request_id}: inputs short of {valid}"
            rows.append(_Row(chunk.request, chunk.start, tokens, chunk.full_from))
            hidden_rows.extend(range(offset, offset + valid))
            offset += chunk.num_tokens
        if rows:
            h = None
            if self.head.needs_hidden:
                assert hidden is not None, "eagle / mtp catch up on the target's hidden states"
                h = hidden[torch.tensor(hidden_rows, device=hidden.device)]  # [T', H]
            # Each row's feature at its last position: it predicts the token after the next one.
            last: torch.Tensor | None = None  # [n, H]
            if self._catch_up_graphed(rows):
                assert self.catch_up_graphs is not None
                last = self.catch_up_graphs.run([r.start for r in rows], [r.tokens for r in rows],
                                                [r.request.page_table for r in rows], h)
            else:
                feats, _ = self.run(self._batch(rows, logits=False), h)
                if feats is not None:
                    ends = itertools.accumulate(len(r.tokens) for r in rows)
                    last = feats[[end - 1 for end in ends]]
            for i, row in enumerate(rows):
                feature = None
                if self.head.needs_hidden:
                    assert last is not None
                    feature = last[i]
                row.request.draft = DraftState(row.start + len(row.tokens), feature)
        self.counters.draft_seconds += time.perf_counter() - t0

    # ---- 2. before the verify -----------------------------------------------------------------
    @torch.inference_mode()
    def draft(self, plan: SchedulePlan) -> None:
        ready = [c for c in plan.chunks if c.max_drafts and self._ready(c)]
        if not ready:
            return
        eagle = self.head.needs_hidden
        feats: torch.Tensor | None = None
        if eagle:  # a landed feature arrives as float32 on the host: to the model's dtype
            feats = torch.stack([_feature(c).to(self.device, self.dtype)
                                 for c in ready])  # [B, H]
        drafts: list[list[int]] = [[] for _ in ready]
        probs: list[list[torch.Tensor]] = [[] for _ in ready]
        for step in range(max(c.max_drafts for c in ready)):
            live = [i for i, c in enumerate(ready) if len(drafts[i]) < c.max_drafts]
            if not live:
                break
            if eagle and step == 0:  # the first draft: the logits of the state's feature
                assert feats is not None
                _, logits = self.run(None, feats[live])
            else:
                rows = []
                for i in live:
                    c = ready[i]
                    last = drafts[i][-1] if drafts[i] else c.request.all_token_ids()[-1]
                    rows.append(_Row(c.request, c.start + step - (1 if eagle else 0), [last]))
                h = feats[live] if feats is not None else None
                new, logits = self._step(rows, h)
                if feats is not None and new is not None:
                    feats[live] = new.to(feats.dtype)
            assert logits is not None
            greedy = logits.argmax(dim=-1).tolist()  # one device sync for the greedy rows
            for j, i in enumerate(live):
                req = ready[i].request
                if req.sampling.greedy:
                    drafts[i].append(greedy[j])
                    continue
                token, q = self._sample(logits[j], req)
                drafts[i].append(token)
                probs[i].append(q)
        for c, ds, ps in zip(ready, drafts, probs, strict=True):
            c.drafts = ds
            c.draft_probs = torch.stack(ps) if ps else None  # [k, V]
            c.num_tokens += len(ds)
            plan.num_tokens += len(ds)

    def _catch_up_graphed(self, rows: list[_Row]) -> bool:
        """A catch-up the graphs take: every row a decode or verify chunk's (at most k + 1
        positions, none over shared pages) and a bucket for their count."""
        graphs = self.catch_up_graphs
        return (graphs is not None and graphs.bucket_for(len(rows)) is not None
                and all(len(r.tokens) <= graphs.width and r.full_from <= r.start for r in rows))

    def _step(self, rows: list[_Row], hidden: torch.Tensor | None,
              ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One single-token head step over `rows`: a graph replay when captured for their
        count, else the eager head call."""
        if self.graphs is not None and self.graphs.bucket_for(len(rows)) is not None:
            return self.graphs.run([r.tokens[0] for r in rows], [r.start for r in rows],
                                   [r.request.page_table for r in rows], hidden)
        return self.run(self._batch(rows, logits=True), hidden)

    def _ready(self, chunk: ScheduledChunk) -> bool:
        """The head's KV covers every token but the last, which this chunk feeds."""
        req, state = chunk.request, chunk.request.draft
        if state is None or state.position != chunk.start or chunk.start != req.num_tokens - 1:
            return False  # e.g. just recomputed after a preemption: its next catch-up mends it
        return state.feature is not None or not self.head.needs_hidden

    @staticmethod
    def _sample(logits: torch.Tensor, req: Request) -> tuple[int, torch.Tensor]:
        """A sampling request's draft from one row of head logits [V]: a draw from the head's
        distribution under the request's knobs, returned with it (rejection sampling's q)."""
        q = target_probs(logits[None].float(), req.sampling)[0]  # [V]
        return int(torch.multinomial(q, 1, generator=req.generator)[0]), q

    def _batch(self, rows: list[_Row], logits: bool) -> ForwardBatch:
        """The head's ForwardBatch: the same pages and slots as the target's for these
        positions; logits of each row's last token when asked."""
        ps = self.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start, seq_lens, last = [0], [], []
        width = max(len(r.request.page_table) for r in rows)
        table = torch.zeros(len(rows), width, dtype=torch.int64)
        for i, r in enumerate(rows):
            pages = r.request.page_table
            span = range(r.start, r.start + len(r.tokens))
            ids.extend(r.tokens)
            positions.extend(span)
            slots.extend(pages[p // ps] * ps + p % ps if p >= r.full_from else -1 for p in span)
            query_start.append(query_start[-1] + len(r.tokens))
            seq_lens.append(span.stop)
            last.append(query_start[-1] - 1)
            table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int64)

        def dev(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        return ForwardBatch(
            input_ids=dev(ids), positions=dev(positions), query_start=dev(query_start),
            seq_lens=dev(seq_lens), page_table=table.to(self.device), slot_mapping=dev(slots),
            logits_indices=dev(last if logits else []), query_start_list=query_start,
            seq_lens_list=seq_lens,
        )
