"""The model runner: turns a schedule plan into one forward pass and samples the next tokens.

`run` is the plain step (the host has the tokens when it returns). `launch` is the overlapped
decode step: forward and sampling are only queued on the device, the tokens' copy to the host
is started, and an `InFlight` is returned; the engine schedules and launches the next step
before it reads these tokens (worker/engine.py).

Constrained requests (a grammar, worker/grammar.py) only run in plain steps: their row of the
step's token bitmask is filled before sampling, and their matcher takes the sampled token after.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from worker.batch import ForwardBatch
from worker.cuda_graphs import DecodeGraphs, StepMirror
from worker.kv_cache import KVCache
from worker.mixed_graphs import MixedGraphs
from worker.model import CausalLM
from worker.model.fp8 import is_fp8
from worker.piecewise import PiecewiseGraphs
from worker.request import Request, TokenLogprob
from worker.sampler import GrammarDeadEnd, NoAllowedToken, Sampler, TokenMask, min_tokens_bans
from worker.spec.drafter import ModelDrafter
from worker.spec.verify import accept, verify_rows
from worker.step import PENDING, RunOutput, ScheduledChunk, SchedulePlan
from worker.verify_graphs import VerifyGraphs


@dataclass
class InFlight:
    """A launched step whose sampled tokens may still be on the device."""

    plan: SchedulePlan
    tokens: torch.Tensor  # [N] int64 on the device: the sampling chunks', in plan order
    host: torch.Tensor | None  # pinned copy target (CUDA); None: `tokens` is already on the host
    copied: torch.cuda.Event | None
    rows: dict[int, int]  # id(request) → its row in `tokens` (chunks that sample)

    def token_ids(self) -> list[int]:
        """Wait for this step's tokens (only this step: the next one may keep the device busy)."""
        if self.copied is None or self.host is None:
            return self.tokens.tolist()  # type: ignore[no-any-return]
        self.copied.synchronize()
        return self.host.tolist()  # type: ignore[no-any-return]


def forward_logits(model: CausalLM, kv: KVCache, batch: ForwardBatch) -> torch.Tensor | None:
    """The model over one batch (even an empty one), then the logits rows it samples from
    (None when it samples nothing). Every rank of a multi-rank worker runs this for its share."""
    hidden = model(batch, kv)  # [T, hidden]
    if not batch.logits_indices.numel():
        return None
    return model.compute_logits(hidden[batch.logits_indices])  # [N, vocab] fp32


def pending_rows(plan: SchedulePlan, prev: InFlight) -> list[int]:
    """Per token of `plan`: the row of `prev.tokens` its input is (-1: the host knows it). Only
    a chunk's last input can be PENDING: the newest token of a request in `prev`."""
    rows: list[int] = []
    for c in plan.chunks:
        rows.extend([-1] * (c.num_tokens - 1))
        req, last = c.request, c.start + c.num_tokens - 1
        pending = last >= req.num_prompt_tokens and (
            req.output_token_ids[last - req.num_prompt_tokens] == PENDING)
        rows.append(prev.rows.get(id(req), -1) if pending else -1)
    return rows


class ModelRunner:
    def __init__(self, model: CausalLM, kv: KVCache, *, eos_token_ids: tuple[int, ...],
                 device: torch.device) -> None:
        self.model = model
        self.kv = kv
        self.page_size = kv.shape.page_size
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.sampler = Sampler()
        self.decode_graphs: DecodeGraphs | None = None  # set by enable_cuda_graphs (CUDA only)
        self.piecewise: PiecewiseGraphs | None = None  # steps with prefill chunks (CUDA only)
        self.mixed_graphs: MixedGraphs | None = None  # those that fit, attention captured too
        self.verify_graphs: VerifyGraphs | None = None  # the same, for verify steps (drafts)
        # speculative decoding's model drafter: it catches up on each step's target hidden
        # states after sampling (worker/spec/drafter.py); None without one
        self.drafter: ModelDrafter | None = None

    def enable_cuda_graphs(self, max_num_seqs: int, max_model_len: int,
                           num_speculative_tokens: int = 0) -> None:
        """Capture decode graphs for batch sizes up to max_num_seqs (call after warm-up); with
        speculative decoding also verify graphs at k + 1 tokens per request (not over FP8 KV
        pages: their paged kernel reads no scales)."""
        graphs = DecodeGraphs(self.model, self.kv, max_num_seqs, max_model_len)
        graphs.capture()
        self.decode_graphs = graphs
        # Not on a CPU (nothing to capture) nor on a multi-rank leader: its followers run a
        # verify step through the eager STEP message (worker/tp_runner.py).
        if (num_speculative_tokens and self.kv.data.is_cuda and not is_fp8(self.kv.data)
                and not isinstance(self.model, StepMirror)):
            verify = VerifyGraphs(self.model, self.kv, max_num_seqs, max_model_len,
                                  num_speculative_tokens)
            verify.capture()
            self.verify_graphs = verify

    def enable_piecewise_graphs(self, max_tokens: int) -> None:
        """Capture graphs around attention for steps of up to max_tokens tokens (after warm-up;
        dense single-rank models only, see worker/piecewise.py)."""
        graphs = PiecewiseGraphs(self.model, self.kv, max_tokens)
        graphs.capture()
        self.piecewise = graphs

    def enable_mixed_graphs(self, max_tokens: int, max_num_seqs: int, max_model_len: int) -> None:
        """Capture whole-step graphs for the steps with prompt tokens that fit them (after
        warm-up; where piecewise graphs run, behind the Triton backend: worker/mixed_graphs.py)."""
        graphs = MixedGraphs(self.model, self.kv, max_tokens, max_num_seqs, max_model_len)
        graphs.capture()
        self.mixed_graphs = graphs

    def build_batch(self, plan: SchedulePlan) -> ForwardBatch:
        page_size = self.page_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        max_pages = max(len(c.request.page_table) for c in plan.chunks)
        page_table = torch.zeros(len(plan.chunks), max_pages, dtype=torch.int64)
        for i, chunk in enumerate(plan.chunks):
            req, start, n = chunk.request, chunk.start, chunk.num_tokens
            table = req.page_table
            input_ids.extend(chunk.input_ids())
            pos = range(start, start + n)
            positions.extend(pos)
            # A replayed token (below full_from) already has its full-layer KV in a shared cached
            # page: -1 = do not write it again.
            slots.extend(table[p // page_size] * page_size + p % page_size
                         if p >= chunk.full_from else -1 for p in pos)
            query_start.append(query_start[-1] + n)
            seq_lens.append(start + n)
            # A verify chunk needs a row per draft + 1; any other sampling chunk its last row.
            end = query_start[-1]
            logits_indices.extend(range(end - chunk.num_logits, end))
            page_table[i, : len(table)] = torch.tensor(table, dtype=torch.int64)

        def dev(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        window = self._window_fields(plan, dev) if self.kv.shape.window_layers else {}
        if self.kv.shape.state_layers:
            window["state_slots"] = dev([c.state_slot for c in plan.chunks])
            window["verify_requests"] = [i for i, c in enumerate(plan.chunks) if c.drafts]
        return ForwardBatch(
            input_ids=dev(input_ids),
            positions=dev(positions),
            query_start=dev(query_start),
            seq_lens=dev(seq_lens),
            page_table=page_table.to(self.device),
            slot_mapping=dev(slots),
            logits_indices=dev(logits_indices),
            query_start_list=query_start,
            seq_lens_list=seq_lens,
            prompt_lens_list=[c.request.num_prompt_tokens for c in plan.chunks],
            **window,
        )

    def _window_fields(self, plan: SchedulePlan,
                       dev: Callable[[list[int]], torch.Tensor]) -> dict[str, Any]:
        """Ring slots of the window layers: where each new token's row goes, and each request's
        history (the up to W-1 tokens before its chunk, from `window_from` on) to read."""
        shape = self.kv.shape
        page_size, window, ring_pages = self.page_size, shape.window, shape.ring_pages
        ring_tokens = ring_pages * page_size
        store: list[int] = []
        history: list[int] = []
        history_start = [0]
        for chunk in plan.chunks:
            ring, start, end = chunk.window_pages, chunk.start, chunk.start + chunk.num_tokens
            assert len(ring) == ring_pages, (
                f"{chunk.request.request_id} holds {len(ring)} ring pages, needs {ring_pages}")

            def slot(p: int, ring: list[int] = ring) -> int:
                return ring[(p // page_size) % ring_pages] * page_size + p % page_size

            # Keep only the last ring_tokens new tokens: earlier ones would be overwritten in the
            # same write (duplicate slots in one scatter have no defined winner on GPU).
            store.extend(slot(p) if p >= end - ring_tokens else -1 for p in range(start, end))
            first = max(start - (window - 1), chunk.window_from, 0)
            history.extend(slot(p) for p in range(first, start))
            history_start.append(len(history))
        return {
            "window_slot_mapping": dev(store),
            "window_context_slots": dev(history),
            "window_context_start": history_start,
        }

    @torch.inference_mode()
    def run(self, plan: SchedulePlan) -> RunOutput:
        if self.drafter is None:
            out = self.sample(plan, self.forward(plan))
            self._commit_states(plan, out)
            return out
        hidden, logits = self.forward_hidden(plan)
        out = self.sample(plan, logits)
        self._commit_states(plan, out)
        # Before the scheduler's update: no page of the plan has been given back yet.
        self.drafter.catch_up(plan, hidden if self.drafter.head.needs_hidden else None, out)
        return out

    def _commit_states(self, plan: SchedulePlan, out: RunOutput) -> None:
        """Recurrent layers: after a verify, each request's state is the one after its last
        accepted token (the forward left it past every draft)."""
        if not self.kv.shape.state_layers or out.more_token_ids is None:
            return
        sampling = [c for c in plan.chunks if c.sample]
        accepted = {c.state_slot: len(more) for c, more in zip(sampling, out.more_token_ids,
                                                                strict=True) if c.drafts}
        if accepted:
            self.model.commit_verified(self.kv, accepted)

    def forward(self, plan: SchedulePlan, prev: InFlight | None = None) -> torch.Tensor | None:
        """One forward pass; the logits [B, vocab] fp32 of the chunks that sample (None: none do).

        `prev` (an overlapped step): an input still PENDING is the previous step's token for
        that request, read from `prev.tokens` on the device.
        """
        return self.forward_hidden(plan, prev)[1]

    def forward_hidden(self, plan: SchedulePlan, prev: InFlight | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`, also returning the final hidden states [T, hidden] of every token."""
        if plan.state_copies:  # new requests' state slots: zeroed or restored from a snapshot
            self.kv.apply_state_copies(plan.state_copies)
        sampling = sum(c.sample for c in plan.chunks)
        src = pending_rows(plan, prev) if prev is not None else None
        graphs = self.decode_graphs
        if (
            graphs is not None
            and sampling == len(plan.chunks)
            and all(c.num_tokens == 1 for c in plan.chunks)  # pure decode
            and graphs.bucket_for(sampling) is not None
        ):
            prev_tokens = prev.tokens if prev is not None else None
            logits = graphs.run(plan.chunks, prev_tokens, src)
            return graphs.hidden(len(plan.chunks)), logits  # replayed
        verify = self.verify_graphs
        if verify is not None and any(c.drafts for c in plan.chunks) and verify.fits(plan.chunks):
            return verify.run(plan.chunks)  # replayed: B x (k + 1) tokens
        mixed = self.mixed_graphs
        if mixed is not None and (bs := mixed.bucket_for(plan.chunks)):
            prev_tokens = prev.tokens if prev is not None else None
            # replayed, attention inside the graph
            hidden, rows = mixed.run(plan.chunks, bs, prev_tokens, src)
            return hidden, self.model.compute_logits(hidden[rows]) if sampling else None
        batch = self.build_batch(plan)  # a PENDING input reads as -1 here, replaced below
        if prev is not None and src is not None:
            rows = torch.tensor(src, device=self.device)
            ids = torch.where(rows >= 0, prev.tokens[rows.clamp(min=0)], batch.input_ids)
            batch = dataclasses.replace(batch, input_ids=ids)
        pieces = self.piecewise
        if pieces is not None and pieces.bucket_for(batch.num_tokens) is not None:
            hidden = pieces.run(batch)  # [T, hidden]: graphs around eager attention
        else:
            hidden = self.model(batch, self.kv)  # [T, hidden]
        if not batch.logits_indices.numel():
            return hidden, None
        return hidden, self.model.compute_logits(hidden[batch.logits_indices])  # [N, vocab] fp32

    @torch.inference_mode()
    def launch(self, plan: SchedulePlan, prev: InFlight | None) -> InFlight:
        """Queue a step without waiting for the device (see `forward` for `prev`); its tokens,
        one per chunk that samples, stay on the device until read (engine `_overlappable`)."""
        reqs = [c.request for c in plan.chunks if c.sample]
        logits = self.forward(plan, prev)
        assert logits is not None  # an overlapped plan has a chunk that samples
        tokens = self.sampler.sample_tokens(logits, [r.sampling for r in reqs],
                                            [r.generator for r in reqs],
                                            [len(r.output_token_ids) for r in reqs],
                                            self.eos_token_ids)
        host = copied = None
        if tokens.is_cuda:
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        return InFlight(plan, tokens, host, copied, {id(r): i for i, r in enumerate(reqs)})

    def sample(self, plan: SchedulePlan, logits: torch.Tensor | None) -> RunOutput:
        """The next token (and logprobs) of every chunk that samples, from its logits rows; a
        verify chunk (with drafts) emits its accepted drafts and one more (worker/spec)."""
        chunks = [c for c in plan.chunks if c.sample]
        if not chunks:
            return RunOutput(token_ids=[], logprobs=[])
        assert logits is not None and logits.shape[0] == sum(c.num_logits for c in chunks)
        if not any(c.drafts for c in chunks):
            return self._sample_rows(chunks, logits)
        starts = [0]
        for c in chunks:
            starts.append(starts[-1] + c.num_logits)
        plain = [i for i, c in enumerate(chunks) if not c.drafts]
        out = self._sample_rows([chunks[i] for i in plain], logits[[starts[i] for i in plain]])
        tokens: list[list[int]] = [[] for _ in chunks]
        for j, i in enumerate(plain):
            tokens[i] = [out.token_ids[j]]
        for i, c in enumerate(chunks):
            if c.drafts:
                req = c.request
                rows = verify_rows(logits[starts[i] : starts[i + 1]], req.sampling,
                                   req.output_token_ids, c.drafts, self.eos_token_ids)
                tokens[i] = accept(rows, c.drafts, req.sampling, req.generator, c.draft_probs)
        return RunOutput(token_ids=[t[0] for t in tokens], logprobs=[None] * len(chunks),
                         more_token_ids=[t[1:] for t in tokens])

    def _sample_rows(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> RunOutput:
        """One token per chunk from its one row of logits (the plain sampler)."""
        sampling = [c.request for c in chunks]
        if not sampling:
            return RunOutput(token_ids=[], logprobs=[])
        mask = self._token_mask(sampling)
        try:
            out = self.sampler.sample(
                logits,
                [r.sampling for r in sampling],
                [r.generator for r in sampling],
                [r.output_token_ids for r in sampling],
                [len(r.output_token_ids) for r in sampling],
                self.eos_token_ids,
                mask,
            )
        except NoAllowedToken as dead:
            raise GrammarDeadEnd(sampling[dead.row].request_id) from None
        if mask is not None:
            for i in mask.rows:
                grammar = sampling[i].grammar
                assert grammar is not None
                grammar.accept(out.token_ids[i])
        logprobs: list[TokenLogprob | None] = [None] * len(sampling)
        if out.logprobs is not None:
            tops = out.top_logprobs or [[] for _ in sampling]
            logprobs = [
                TokenLogprob(tok, lp, top)
                if r.sampling.logprobs or r.sampling.top_logprobs else None
                for r, tok, lp, top in zip(sampling, out.token_ids, out.logprobs, tops, strict=True)
            ]
        return RunOutput(token_ids=list(out.token_ids), logprobs=logprobs)

    def _token_mask(self, reqs: list[Request]) -> TokenMask | None:
        """The step's grammar bitmask; None when no request in it is constrained."""
        if all(r.grammar is None for r in reqs):
            return None
        # Loaded with the first grammar: xgrammar is heavy (worker/grammar.py).
        from worker.grammar_xgr import token_mask

        bans = [min_tokens_bans(r.sampling, len(r.output_token_ids), self.eos_token_ids)
                if r.grammar is not None else [] for r in reqs]
        return token_mask([r.grammar for r in reqs], [r.output_token_ids for r in reqs], bans)
