"""The ranks of one multi-rank worker: process group, rank processes, and the step channel.

One worker = `tp_size * dp_size` rank processes. The process that `tandem worker` starts on
node 0 is global rank 0: it runs the gRPC server, the scheduler and the sampler, and it
spawns its node's other ranks. On other nodes `tandem worker ... --node-rank k` spawns that
node's ranks and serves nothing. Every rank joins one process group (gloo on CPU, NCCL on
CUDA) at `parallel.dist_init_addr`.

Followers never schedule. Rank 0 drives them through a `StepChannel`: every message is a
broadcast of a small int64 header `[kind, payload_len]` and then an int64 payload:

- STEP:  a packed `ForwardBatch`; every rank runs the forward (and the vocab-parallel logits).
- ROOMS: PD room commands (create sender / receiver with the same page ids, send pages,
         abort), followed by an all-gather of every rank's room end states (`tp_runner`).
- STOP:  followers close their transfer manager and exit.
- DRAFT: a draft head's call (speculative decoding, worker/spec/tp.py): its packed batch, then
         its hidden input as a broadcast of its own.
- DP_STEP: attention DP (`dp_size > 1`): one packed `ForwardBatch` per DP group (an empty one
         for an idle group, which still joins the MoE collectives); each rank runs its group's
         batch, and each group's first rank sends its logits rows to rank 0 (worker/dp_runner.py).
- CAPTURE: `[max_num_seqs, max_model_len]`: every rank builds its decode graphs
         (worker/cuda_graphs.py) and captures the same buckets beside rank 0.
- GRAPH_STEP: the flat input prefix of one bucket, broadcast straight into every rank's static
         graph buffer (`share`); every rank replays that bucket. Its length names the bucket.
- DP_GRAPH_STEP: `[bucket, rows of group 0, ..., rows of group G-1]`, then every group's input
         prefix in one `share`; each rank loads its group's and replays the bucket; each
         group's first rank sends its logits rows to rank 0.

Why int64 tensors and not pickled objects: the process group is a network path between
nodes, and nothing a peer sends us is unpickled (DESIGN: no pickle on a reachable path).
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist

from worker.batch import ForwardBatch
from worker.config import ConfigError, ParallelConfig, WorkerConfig

# Followers wait in a broadcast while rank 0 is idle, for as long as the worker lives; a
# dead rank 0 closes its sockets and the follower's wait fails at once, not at this timeout.
IDLE_TIMEOUT = datetime.timedelta(days=7)


class DistributedError(RuntimeError):
    """The worker's ranks cannot be set up or lost each other; the message says which and why."""


class MessageKind(enum.IntEnum):
    STEP = 1
    ROOMS = 2
    STOP = 3
    DP_STEP = 4
    CAPTURE = 5
    GRAPH_STEP = 6
    DP_GRAPH_STEP = 7
    DRAFT = 8  # a speculative-decoding draft head call (worker/spec/tp.py)


@dataclass(frozen=True)
class RankPlace:
    """Where one rank process sits in the worker."""

    global_rank: int  # in the worker's process group
    local_rank: int  # on its node (picks cuda:N)
    world_size: int
    tp_rank: int  # in its attention TP group
    dp_rank: int  # which attention DP group


def place(parallel: ParallelConfig, local_rank: int) -> RankPlace:
    per_node = parallel.world_size // parallel.nnodes
    g = parallel.node_rank * per_node + local_rank
    tp = parallel.tp_size
    return RankPlace(g, local_rank, parallel.world_size, g % tp, g // tp)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def with_init_addr(config: WorkerConfig) -> WorkerConfig:
    """Fill `dist_init_addr` with a free local port for a single-node worker that left it empty."""
    par = config.parallel
    if par.dist_init_addr or par.world_size == 1:
        return config
    if par.nnodes > 1:
        raise ConfigError("parallel.dist_init_addr must be set (tcp://HOST:PORT of node 0) when "
                          "nnodes > 1")
    addr = f"tcp://127.0.0.1:{free_port()}"
    return config.replace(parallel=dataclasses.replace(par, dist_init_addr=addr))


def rank_config(config: WorkerConfig, where: RankPlace) -> WorkerConfig:
    """The per-rank copy of a worker config: its TP rank and device."""
    par = config.parallel
    device = par.device
    if device.startswith("cuda"):
        device = f"cuda:{where.local_rank}"  # one GPU per local rank
    return config.replace(parallel=dataclasses.replace(par, tp_rank=where.tp_rank, device=device))


def init_process_group(parallel: ParallelConfig, where: RankPlace) -> None:
    """Join the worker's process group (blocks until every rank has joined)."""
    backend = "nccl" if parallel.device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(where.local_rank)
    dist.init_process_group(backend, init_method=parallel.dist_init_addr, rank=where.global_rank,
                            world_size=where.world_size, timeout=IDLE_TIMEOUT)


def spawn_local_ranks(config: WorkerConfig, target: Callable[[WorkerConfig, int, int], None],
                      first_local_rank: int) -> list[BaseProcess]:
    """Start this node's ranks from `first_local_rank` on, each running
    `target(config, local_rank, parent_pid)` (worker/tp_runner.py's `follower_main`)."""
    ctx = torch.multiprocessing.get_context("spawn")
    per_node = config.parallel.world_size // config.parallel.nnodes
    procs: list[BaseProcess] = []
    for local in range(first_local_rank, per_node):
        p = ctx.Process(target=target, args=(config, local, os.getpid()),
                        name=f"tandem-rank-l{local}", daemon=False)
        p.start()
        procs.append(p)
    return procs


# ---- packing ---------------------------------------------------------------------------------

U64 = 1 << 64


def to_i64(value: int) -> int:
    """A 64-bit room id (unsigned) as the int64 it travels in."""
    return value - U64 if value >= 1 << 63 else value


def from_i64(value: int) -> int:
    return value + U64 if value < 0 else value


def pack_str(text: str) -> list[int]:
    data = text.encode()
    return [len(data), *data]


def unpack_str(values: list[int], at: int) -> tuple[str, int]:
    n = values[at]
    return bytes(values[at + 1 : at + 1 + n]).decode(), at + 1 + n


def pack_batch(batch: ForwardBatch) -> torch.Tensor:
    """ForwardBatch → one int64 tensor: [T, B, P, N] then the seven tensors, flattened, then
    the prompt lengths (-1 each where the batch has none)."""
    b, p = batch.page_table.shape
    head = torch.tensor([batch.num_tokens, b, p, int(batch.logits_indices.shape[0])],
                        dtype=torch.int64)
    prompt_lens = torch.tensor(batch.prompt_lens_list or [-1] * b, dtype=torch.int64)
    parts = [head, batch.input_ids, batch.positions, batch.query_start, batch.seq_lens,
             batch.page_table.reshape(-1), batch.slot_mapping, batch.logits_indices, prompt_lens]
    return torch.cat([t.to("cpu", torch.int64) for t in parts])


def empty_batch(device: torch.device) -> ForwardBatch:
    """A step with no tokens: an idle DP group's share (it still runs the layers' collectives)."""
    none = torch.zeros(0, dtype=torch.int64, device=device)
    return ForwardBatch(input_ids=none, positions=none,
                        query_start=torch.zeros(1, dtype=torch.int64, device=device),
                        seq_lens=none,
                        page_table=torch.zeros(0, 1, dtype=torch.int64, device=device),
                        slot_mapping=none, logits_indices=none, query_start_list=[0],
                        seq_lens_list=[])


def pack_batches(batches: list[ForwardBatch]) -> torch.Tensor:
    """One batch per DP group → [G, len_0, ..., len_{G-1}] then each packed batch."""
    packed = [pack_batch(b) for b in batches]
    head = torch.tensor([len(packed), *(int(t.numel()) for t in packed)], dtype=torch.int64)
    return torch.cat([head, *packed])


def unpack_group_batch(flat: torch.Tensor, group: int, device: torch.device) -> ForwardBatch:
    """DP group `group`'s batch out of `pack_batches`."""
    g = int(flat[0])
    lens = [int(n) for n in flat[1 : 1 + g]]
    start = 1 + g + sum(lens[:group])
    return unpack_batch(flat[start : start + lens[group]], device)


def unpack_batch(flat: torch.Tensor, device: torch.device) -> ForwardBatch:
    t, b, p, n = (int(v) for v in flat[:4])
    sizes = [t, t, b + 1, b, b * p, t, n, b]
    ids, pos, qs, seq, table, slots, li, prompt = flat[4:].split(sizes)
    prompt_lens = prompt.tolist()
    return ForwardBatch(
        input_ids=ids.to(device), positions=pos.to(device), query_start=qs.to(device),
        seq_lens=seq.to(device), page_table=table.reshape(b, p).to(device),
        slot_mapping=slots.to(device), logits_indices=li.to(device),
        query_start_list=qs.tolist(), seq_lens_list=seq.tolist(),
        prompt_lens_list=None if -1 in prompt_lens else prompt_lens,
    )


# ---- the channel -----------------------------------------------------------------------------


class StepChannel:
    """Rank 0 → every rank broadcasts, plus the all-gather that answers a ROOMS message.

    Collectives go over CPU tensors on gloo and device tensors on NCCL (`device`).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device if dist.get_backend() == "nccl" else torch.device("cpu")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def send(self, kind: MessageKind, payload: torch.Tensor | None = None) -> None:
        """Rank 0: broadcast one message."""
        assert self.rank == 0
        n = 0 if payload is None else int(payload.numel())
        dist.broadcast(torch.tensor([int(kind), n], dtype=torch.int64, device=self.device), src=0)
        if n:
            dist.broadcast(payload.to(self.device), src=0)  # type: ignore[union-attr]

    def recv(self) -> tuple[MessageKind, torch.Tensor | None]:
        """Followers: wait for the next message."""
        kind, n = self.recv_head()
        return kind, (self.recv_payload(n) if n else None)

    def recv_head(self) -> tuple[MessageKind, int]:
        """Followers: the next message's kind and payload length (the payload comes next)."""
        head = torch.empty(2, dtype=torch.int64, device=self.device)
        dist.broadcast(head, src=0)
        kind, n = (int(v) for v in head.cpu())
        return MessageKind(kind), n

    def recv_payload(self, n: int) -> torch.Tensor:
        """Followers: the payload of `n` int64s announced by `recv_head`, on the host."""
        payload = torch.empty(n, dtype=torch.int64, device=self.device)
        dist.broadcast(payload, src=0)
        return payload.cpu()

    def share(self, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` into every rank's (same shape, on this channel's device): a graph
        step's inputs land straight in the followers' static buffers."""
        dist.broadcast(tensor, src=0)

    def all_gather_lists(self, mine: list[int]) -> list[list[int]]:
        """Every rank's int list, in rank order (lengths may differ)."""
        n = torch.tensor([len(mine)], dtype=torch.int64, device=self.device)
        lens = [torch.empty_like(n) for _ in range(self.world_size)]
        dist.all_gather(lens, n)
        width = max(int(x) for x in lens)
        if width == 0:
            return [[] for _ in range(self.world_size)]
        padded = torch.zeros(width, dtype=torch.int64, device=self.device)
        padded[: len(mine)] = torch.tensor(mine, dtype=torch.int64)
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded)
        return [p[: int(k)].cpu().tolist() for p, k in zip(parts, lens, strict=True)]
