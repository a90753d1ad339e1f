"""Attention data parallelism at run time: one step = every DP group's own batch, together.

A worker with `dp_size = G` groups of `tp_size` ranks keeps G schedulers on rank 0 (one per
group, each with its own pages: every group holds its own KV pool) and steps them together,
as SGLang's DP attention does. Each step rank 0 packs the G batches into one DP_STEP message;
every rank runs its group's batch — an idle group runs an empty one, because the MoE layers'
all-to-all needs every rank in every step. Attention (and dense MLPs) stay inside a group; only
the expert-parallel MoE layers cross groups.

Logits: a group's TP ranks gather their vocab shards as usual (worker/model/layers.py), then the
group's first rank sends its rows to rank 0, which samples for every group (all request state
lives there). The shapes are known on both sides from the batches, so nothing but the rows
travels.

Decode graphs (`enable_cuda_graphs`): every rank captures the same buckets. A step in which
every group decodes (or idles) replays ONE bucket on every rank — the largest group's, so the
MoE layers' fixed-capacity all-to-alls (worker/model/moe_static.py) match — with each group's
inputs filled on rank 0 and sent in one DP_GRAPH_STEP; an idle group replays all padding rows.
Any other step (a prefill chunk anywhere, a batch past the largest bucket) runs eagerly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from worker.cuda_graphs import DecodeGraphs
from worker.distributed import (
    MessageKind,
    StepChannel,
    empty_batch,
    pack_batches,
    unpack_group_batch,
)
from worker.kv_cache import KVCache
from worker.model.base import CausalLM
from worker.runner import ModelRunner, forward_logits
from worker.step import RunOutput, SchedulePlan


class DPRunner:
    """Rank 0's runner when `dp_size > 1`: G plans in, G outputs out, one forward per rank."""

    def __init__(self, runner: ModelRunner, channel: StepChannel, tp_size: int, dp_size: int,
                 vocab_size: int) -> None:
        self.runner = runner  # rank 0's single-rank runner: builds batches, runs group 0, samples
        self.channel = channel
        self.tp_size, self.dp_size = tp_size, dp_size
        self.vocab_size = vocab_size
        self.graphs: DecodeGraphs | None = None  # set by enable_cuda_graphs
        self._host: torch.Tensor | None = None  # every group's input prefix, filled per step

    def enable_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Every rank captures the same decode buckets (each group's largest batch)."""
        sizes = torch.tensor([max_num_seqs, max_model_len], dtype=torch.int64)
        self.channel.send(MessageKind.CAPTURE, sizes)
        graphs = DecodeGraphs(self.runner.model, self.runner.kv, max_num_seqs, max_model_len)
        graphs.capture()
        size = self.dp_size * graphs.used_len(graphs.max_bs)
        # Pinned on CUDA; reused every step: each step's sampling syncs before the next fill.
        self._host = torch.zeros(size, dtype=torch.int64, pin_memory=graphs.replays)
        self.graphs = graphs

    @torch.inference_mode()
    def run(self, plans: list[SchedulePlan]) -> list[RunOutput]:
        bs = self._graph_bucket(plans)
        logits = self._graph_step(plans, bs) if bs is not None else self._eager_step(plans)
        return [self.runner.sample(p, lg) for p, lg in zip(plans, logits, strict=True)]

    def _eager_step(self, plans: list[SchedulePlan]) -> list[torch.Tensor | None]:
        device = self.runner.device
        batches = [self.runner.build_batch(p) if p.chunks else empty_batch(device) for p in plans]
        self.channel.send(MessageKind.DP_STEP, pack_batches(batches))
        first = forward_logits(self.runner.model, self.runner.kv, batches[0])
        return [first, *self._gather_rows([int(b.logits_indices.shape[0]) for b in batches])]

    def _gather_rows(self, rows: list[int]) -> list[torch.Tensor | None]:
        """Groups 1..G-1's logits rows, from each group's first rank."""
        out: list[torch.Tensor | None] = []
        for group, n in enumerate(rows[1:], start=1):
            if not n:
                out.append(None)
                continue
            got = torch.empty(n, self.vocab_size, dtype=torch.float32, device=self.channel.device)
            dist.recv(got, src=group * self.tp_size)
            out.append(got.to(self.runner.device))
        return out

    def _graph_bucket(self, plans: list[SchedulePlan]) -> int | None:
        """The bucket every rank replays this step, or None for an eager step."""
        if self.graphs is None or all(p.empty for p in plans):
            return None
        for p in plans:
            if p.state_copies or any(c.num_tokens != 1 or not c.sample for c in p.chunks):
                return None  # a prefill chunk (or a verify) somewhere: eager
        return self.graphs.bucket_for(max(len(p.chunks) for p in plans))

    def _graph_step(self, plans: list[SchedulePlan], bs: int) -> list[torch.Tensor | None]:
        graphs, host = self.graphs, self._host
        assert graphs is not None and host is not None
        used = graphs.used_len(bs)
        for group, plan in enumerate(plans):  # an idle group: every row padding
            graphs.fill(host[group * used : (group + 1) * used], plan.chunks, bs)
        inputs = host[: len(plans) * used].to(self.runner.device, non_blocking=True)
        rows = [len(p.chunks) for p in plans]
        self.channel.send(MessageKind.DP_GRAPH_STEP, torch.tensor([bs, *rows], dtype=torch.int64))
        self.channel.share(inputs)
        graphs.load(inputs[:used])
        logits = graphs.replay(bs)  # even when group 0 idles: its ranks join the collectives
        return [logits[: rows[0]] if rows[0] else None, *self._gather_rows(rows)]


def follow_dp_graph_step(counts: torch.Tensor, graphs: DecodeGraphs, channel: StepChannel,
                         tp_size: int) -> None:
    """A follower's DP_GRAPH_STEP: load its group's inputs, replay the bucket; a group's first
    rank ships its logits rows to rank 0."""
    bs, *rows = (int(v) for v in counts)
    used = graphs.used_len(bs)
    inputs = torch.empty(len(rows) * used, dtype=torch.int64, device=channel.device)
    channel.share(inputs)
    group = channel.rank // tp_size
    graphs.load(inputs[group * used : (group + 1) * used])
    logits = graphs.replay(bs)
    if rows[group] and channel.rank % tp_size == 0:  # rank 0 itself never follows
        dist.send(logits[: rows[group]].to(channel.device).contiguous(), dst=0)


def follow_dp_step(payload: torch.Tensor, model: CausalLM, kv: KVCache, device: torch.device,
                   channel: StepChannel, tp_size: int) -> None:
    """A follower's DP_STEP: run its group's batch; a group's first rank ships the logits to
    rank 0."""
    rank = channel.rank
    batch = unpack_group_batch(payload, rank // tp_size, device)
    logits = forward_logits(model, kv, batch)
    if logits is not None and rank % tp_size == 0:  # rank 0 itself never follows
        dist.send(logits.to(channel.device).contiguous(), dst=0)
