"""Multi-rank workers at run time: rank 0's leader and the follower loop.

Rank 0 (`TPLeader`): spawns its node's follower ranks, joins the process group, and
broadcasts each step's batch before its own forward (`LeaderModel`; with attention DP the
`DPRunner` sends every group's batch instead). In PD roles it wraps its `KVTransferManager`
in a `TPTransferManager` (worker/rank_rooms.py): rooms on every rank of their DP group.

Followers (`follower_main`): load their shard, allocate the same KV pool, open their own
transfer manager (and bootstrap service on prefill), then obey rank 0's messages until STOP.
They never schedule and never sample. Decode graphs: on CAPTURE every follower captures the
same buckets as rank 0 (worker/cuda_graphs.py); on GRAPH_STEP it receives the step's inputs
straight into its graph buffer and replays that bucket — replay bypasses `forward`, so the
step travels outside the graph.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from transfer.manager import KVTransferManager
from worker.batch import ForwardBatch
from worker.cache_layout import kv_shape
from worker.config import WorkerConfig
from worker.cuda_graphs import DecodeGraphs
from worker.distributed import (
    DistributedError,
    MessageKind,
    StepChannel,
    init_process_group,
    pack_batch,
    place,
    rank_config,
    spawn_local_ranks,
    unpack_batch,
    with_init_addr,
)
from worker.dp_runner import follow_dp_graph_step, follow_dp_step
from worker.kv_cache import KVCache
from worker.model import load_model
from worker.model.base import CausalLM, WeightSlot
from worker.rank_rooms import FollowerRooms, TPTransferManager, exchange_bootstrap_addrs
from worker.runner import forward_logits

log = logging.getLogger(__name__)

# ---- rank 0 ----------------------------------------------------------------------------------


class TPLeader:
    """Rank 0's side of a multi-rank worker: followers, process group, step broadcast."""

    def __init__(self, config: WorkerConfig) -> None:
        config = with_init_addr(config)
        self.config = config
        where = place(config.parallel, 0)
        if where.global_rank != 0:
            raise DistributedError("TPLeader runs on node 0's first rank; other nodes run "
                                   "run_node()")
        self.procs = spawn_local_ranks(config, follower_main, first_local_rank=1)
        init_process_group(config.parallel, where)
        self.channel = StepChannel(torch.device(config.parallel.device))
        self._closed = False

    def broadcast_batch(self, batch: ForwardBatch) -> None:
        """Before rank 0's forward: every follower runs the same batch on its shard."""
        self.channel.send(MessageKind.STEP, pack_batch(batch))

    def wrap_model(self, model: CausalLM) -> CausalLM:
        return LeaderModel(model, self)

    def wrap_manager(self, manager: KVTransferManager, bootstrap_addr: str,
                     group_of_room: Callable[[int], int]) -> tuple[TPTransferManager, str]:
        """Rooms on the ranks of their DP group; returns the facade and every rank's bootstrap
        address (rank order; DP groups separated by ';')."""
        tp = self.config.parallel.tp_size
        addrs = exchange_bootstrap_addrs(self.channel, bootstrap_addr, tp)
        return TPTransferManager(manager, self.channel, tp, group_of_room), addrs

    def close(self, timeout_s: float = 30.0) -> None:
        """STOP the followers and wait for them (rank 0's engine thread has stopped stepping)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.channel.send(MessageKind.STOP)
        finally:
            for p in self.procs:
                p.join(timeout=timeout_s)
                if p.is_alive():
                    log.error("rank process %s did not stop in %.0f s; terminating it", p.name,
                              timeout_s)
                    p.terminate()
            dist.destroy_process_group()


class LeaderModel(CausalLM):
    """Rank 0's model: broadcasts each batch to the followers, then runs its own shard.

    Wrapping the model (rather than the runner) keeps the single-rank runner untouched; every
    forward the runner makes is mirrored on every rank, in order. Decode graphs replay without
    calling forward: they see a `StepMirror` (worker/cuda_graphs.py) and call `mirror_capture`
    and `mirror_replay`, which send CAPTURE and GRAPH_STEP instead.
    """

    def __init__(self, inner: CausalLM, leader: TPLeader) -> None:
        super().__init__()
        self.inner = inner
        self._leader = leader

    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        self._leader.broadcast_batch(batch)
        return self.inner(batch, kv)  # type: ignore[no-any-return]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner.compute_logits(hidden)

    @property
    def supports_cuda_graphs(self) -> bool:
        return self.inner.supports_cuda_graphs  # the step goes out in mirror_replay

    def weight_slots(self) -> dict[str, WeightSlot]:
        return self.inner.weight_slots()

    # ---- StepMirror (worker/cuda_graphs.py) ----------------------------------------------------
    @property
    def local_model(self) -> CausalLM:
        return self.inner

    def mirror_capture(self, max_num_seqs: int, max_model_len: int) -> None:
        sizes = torch.tensor([max_num_seqs, max_model_len], dtype=torch.int64)
        self._leader.channel.send(MessageKind.CAPTURE, sizes)

    def mirror_replay(self, inputs: torch.Tensor) -> None:
        self._leader.channel.send(MessageKind.GRAPH_STEP, inputs)  # on the device: no host hop


def _exit_with_parent(parent_pid: int) -> None:
    """A follower must not outlive the process that spawned it (no orphaned rank holding a GPU)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(1.0)


def follower_main(config: WorkerConfig, local_rank: int, parent_pid: int) -> None:
    """Entry point of a follower rank process (spawned by `spawn_local_ranks`)."""
    where = place(config.parallel, local_rank)
    cfg = rank_config(config, where)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s {cfg.role} rank{where.global_rank} %(levelname)s "
                               "%(name)s: %(message)s")
    # Rank 0 owns shutdown: it sends STOP and joins us. A launcher signals the whole process
    # group at once (Ctrl-C, SIGTERM); dying on that signal would cut rank 0's STOP broadcast
    # short (gloo "Connection closed by peer" in its log). If rank 0 dies instead, the parent
    # watch below ends us; the launcher's SIGKILL after its grace period is the last resort.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    if cfg.num_threads > 0:
        torch.set_num_threads(cfg.num_threads)
    init_process_group(cfg.parallel, where)
    rooms: FollowerRooms | None = None
    try:
        device = torch.device(cfg.parallel.device)
        model, spec = load_model(cfg.model, cfg.parallel)
        kv = KVCache(kv_shape(spec, cfg), device)  # the leader's shape: same max_model_len
        channel = StepChannel(device)
        if cfg.role != "both":
            rooms = FollowerRooms(cfg, kv, spec.num_kv_heads, spec.fingerprint, spec.architecture,
                                  where.global_rank)
            exchange_bootstrap_addrs(channel, rooms.bootstrap_addr, cfg.parallel.tp_size)
        serve_follower(channel, model, kv, rooms, device, cfg.parallel.tp_size)
    finally:
        if rooms is not None:
            rooms.close()
        if dist.is_initialized():
            dist.destroy_process_group()


@torch.inference_mode()
def serve_follower(channel: StepChannel, model: CausalLM, kv: KVCache, rooms: FollowerRooms | None,
                   device: torch.device, tp_size: int) -> None:
    """Obey rank 0 until STOP: forwards on our shard, graph steps, room commands, reports."""
    graphs: DecodeGraphs | None = None  # built on CAPTURE
    while True:
        kind, n = channel.recv_head()
        if kind is MessageKind.GRAPH_STEP:  # the inputs land straight in the graph buffer
            if graphs is None:
                raise DistributedError("rank 0 sent a graph step before CAPTURE")
            bs = graphs.bucket_of_len(n)
            channel.share(graphs.inputs(bs))
            graphs.replay(bs)  # joins the layers' and the vocab's collectives
            continue
        payload = channel.recv_payload(n) if n else None
        if kind is MessageKind.CAPTURE:
            assert payload is not None
            max_num_seqs, max_model_len = (int(v) for v in payload)
            graphs = DecodeGraphs(model, kv, max_num_seqs, max_model_len)
            graphs.capture()  # the same buckets, in the same order, as rank 0
        elif kind is MessageKind.DP_GRAPH_STEP:
            if graphs is None:
                raise DistributedError("rank 0 sent a DP graph step before CAPTURE")
            assert payload is not None
            follow_dp_graph_step(payload, graphs, channel, tp_size)
        elif kind is MessageKind.DP_STEP:
            assert payload is not None
            follow_dp_step(payload, model, kv, device, channel, tp_size)
        elif kind is MessageKind.STEP:
            assert payload is not None
            # joins the layers' and the vocab's collectives
            forward_logits(model, kv, unpack_batch(payload, device))
        elif kind is MessageKind.ROOMS:
            if rooms is None:
                raise DistributedError("rank 0 sent room commands to a worker with role 'both'")
            rooms.apply([] if payload is None else payload.tolist())
            channel.all_gather_lists(rooms.report())
        else:
            return


def run_node(config: WorkerConfig) -> None:
    """`tandem worker --node-rank k` (k > 0): run this node's ranks until they exit; serves
    nothing."""
    par = config.parallel
    if par.node_rank == 0:
        raise DistributedError("run_node is for nodes 1..nnodes-1; node 0 runs the worker server "
                               "(run_worker)")
    procs = spawn_local_ranks(config, follower_main, first_local_rank=0)
    codes = []
    for p in procs:
        p.join()
        codes.append(p.exitcode)
    if any(codes):
        raise DistributedError(f"node {par.node_rank}: rank processes exited with codes {codes}")
