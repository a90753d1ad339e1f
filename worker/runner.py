"""The model runner: turns a schedule plan into one forward pass and samples the next tokens."""

from __future__ import annotations

import torch

from worker.batch import ForwardBatch
from worker.cuda_graphs import DecodeGraphs
from worker.kv_cache import KVCache
from worker.model import CausalLM
from worker.request import TokenLogprob
from worker.sampler import Sampler
from worker.scheduler import RunOutput, SchedulePlan


class ModelRunner:
    def __init__(self, model: CausalLM, kv: KVCache, *, eos_token_ids: tuple[int, ...], device: torch.device) -> None:
        self.model = model
        self.kv = kv
        self.page_size = kv.shape.page_size
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.sampler = Sampler()
        self.decode_graphs: DecodeGraphs | None = None  # set by enable_cuda_graphs (CUDA only)

    def enable_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Capture decode graphs for batch sizes up to max_num_seqs (call after warm-up)."""
        graphs = DecodeGraphs(self.model, self.kv, max_num_seqs, max_model_len)
        graphs.capture()
        self.decode_graphs = graphs

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
            input_ids.extend(req.all_token_ids()[start : start + n])
            pos = range(start, start + n)
            positions.extend(pos)
            slots.extend(table[p // page_size] * page_size + p % page_size for p in pos)
            query_start.append(query_start[-1] + n)
            seq_lens.append(start + n)
            if chunk.sample:
                logits_indices.append(query_start[-1] - 1)
            page_table[i, : len(table)] = torch.tensor(table, dtype=torch.int64)

        def dev(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

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
        )

    @torch.inference_mode()
    def run(self, plan: SchedulePlan) -> RunOutput:
        sampling = [c.request for c in plan.chunks if c.sample]
        graphs = self.decode_graphs
        if (
            graphs is not None
            and len(sampling) == len(plan.chunks)
            and all(c.num_tokens == 1 for c in plan.chunks)  # pure decode
            and graphs.bucket_for(len(sampling)) is not None
        ):
            logits = graphs.run(plan.chunks)  # [B, vocab] fp32, replayed
        else:
            batch = self.build_batch(plan)
            hidden = self.model(batch, self.kv)  # [T, hidden]
            if not sampling:
                return RunOutput(token_ids=[], logprobs=[])
            logits = self.model.compute_logits(hidden[batch.logits_indices])  # [B, vocab] fp32
        out = self.sampler.sample(
            logits,
            [r.sampling for r in sampling],
            [r.generator for r in sampling],
            [r.output_token_ids for r in sampling],
            [len(r.output_token_ids) for r in sampling],
            self.eos_token_ids,
        )
        logprobs: list[TokenLogprob | None] = [None] * len(sampling)
        if out.logprobs is not None:
            tops = out.top_logprobs or [[] for _ in sampling]
            logprobs = [
                TokenLogprob(tok, lp, top) if r.sampling.logprobs or r.sampling.top_logprobs else None
                for r, tok, lp, top in zip(sampling, out.token_ids, out.logprobs, tops, strict=True)
            ]
        return RunOutput(token_ids=list(out.token_ids), logprobs=logprobs)
