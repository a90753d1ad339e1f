"""A draft head on a multi-rank worker: rank 0 broadcasts each head call, every rank runs it.

The head's layers are tensor-parallel like the target's (each rank holds its KV heads of the
head's layers in its own pages), so every call rank 0's drafter makes (worker/spec/drafter.py)
runs on every rank, in order, right after the target's STEP it follows. A DRAFT message is
`[has_batch, num_rows]` then the packed ForwardBatch (worker/distributed.py); the hidden input,
when the head reads one, follows as one broadcast of [rows, hidden] in the model dtype (on a
prefill chunk that is the target's hidden states of the chunk, which rank 0 alone keeps past
the step: followers keep nothing between messages).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from worker.batch import ForwardBatch
from worker.distributed import MessageKind, StepChannel, pack_batch, unpack_batch
from worker.kv_cache import KVCache
from worker.spec.drafter import HeadRun, run_head
from worker.spec.heads import DraftHead


def leader_head_run(head: DraftHead, kv: KVCache, channel: StepChannel) -> HeadRun:
    """Rank 0's head call: tell the followers, then run our shard."""

    def run(batch: ForwardBatch | None,
            hidden: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        rows = batch.num_tokens if batch is not None else (0 if hidden is None else hidden.shape[0])
        head_part = torch.tensor([int(batch is not None), rows, int(hidden is not None)],
                                 dtype=torch.int64)
        parts = [head_part] if batch is None else [head_part, pack_batch(batch)]
        channel.send(MessageKind.DRAFT, torch.cat(parts))
        if hidden is not None:
            dist.broadcast(hidden.contiguous().to(channel.device), src=0)
        return run_head(head, kv, batch, hidden)

    return run


@torch.inference_mode()
def follow_draft(payload: torch.Tensor, head: DraftHead | None, kv: KVCache,
                 device: torch.device, channel: StepChannel, hidden_size: int,
                 dtype: torch.dtype) -> None:
    """A follower's DRAFT: the same head call on its shard (joins the layers' collectives)."""
    if head is None:
        raise RuntimeError("rank 0 sent a DRAFT step to a rank that loaded no draft head; "
                           "every rank must load the same speculative config")
    has_batch, rows, has_hidden = (int(v) for v in payload[:3])
    batch = unpack_batch(payload[3:], device) if has_batch else None
    hidden = None
    if has_hidden:
        hidden = torch.empty(rows, hidden_size, dtype=dtype, device=channel.device)
        dist.broadcast(hidden, src=0)
        hidden = hidden.to(device)
    run_head(head, kv, batch, hidden)
