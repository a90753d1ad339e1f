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
"""

from __future__ import annotations

import torch
import torch.distributed as dist

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

    def __init__(self, runner: ModelRunner, channel: StepChannel, tp_size: int, dp_size: int, vocab_size: int) -> None:
        self.runner = runner  # rank 0's single-rank runner: builds batches, runs group 0, samples
        self.channel = channel
        self.tp_size, self.dp_size = tp_size, dp_size
        self.vocab_size = vocab_size

    @torch.inference_mode()
    def run(self, plans: list[SchedulePlan]) -> list[RunOutput]:
        device = self.runner.device
        batches = [self.runner.build_batch(p) if p.chunks else empty_batch(device) for p in plans]
        self.channel.send(MessageKind.DP_STEP, pack_batches(batches))
        logits = [forward_logits(self.runner.model, self.runner.kv, batches[0])]
        for group, batch in enumerate(batches[1:], start=1):
            rows = int(batch.logits_indices.shape[0])
            if not rows:
                logits.append(None)
                continue
            got = torch.empty(rows, self.vocab_size, dtype=torch.float32, device=self.channel.device)
            dist.recv(got, src=group * self.tp_size)
            logits.append(got.to(device))
        return [self.runner.sample(p, lg) for p, lg in zip(plans, logits, strict=True)]


def follow_dp_step(payload: torch.Tensor, model: CausalLM, kv: KVCache, device: torch.device, channel: StepChannel,
                   tp_size: int) -> None:
    """A follower's DP_STEP: run its group's batch; a group's first rank ships the logits to rank 0."""
    rank = channel.rank
    batch = unpack_group_batch(payload, rank // tp_size, device)
    logits = forward_logits(model, kv, batch)
    if logits is not None and rank % tp_size == 0:  # rank 0 itself never follows
        dist.send(logits.to(channel.device).contiguous(), dst=0)
